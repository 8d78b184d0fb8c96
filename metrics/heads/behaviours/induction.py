"""Prefix matching, under its two names: ``induction`` on the repeated probe (Olsson et al. 2022, "In-context
Learning and Induction Heads": one earlier copy, a deterministic continuation) and
``statistical_induction`` on a task's own sequences such as Markov chains (Edelman et al. 2024, "The
Evolution of Statistical Induction Heads": many earlier occurrences, whose followers are the in-context
bigram counts). The same targets; a run reads the one its task names (``Task.reader_behaviour``)."""

from metrics.heads.behaviours.base import Behaviour, TokenRelations


class Induction(Behaviour):
    """``{1 <= j <= q : x_{j-1} = x_q}``: the token after each earlier occurrence of the current token."""

    name = "induction"
    colour = "tab:red"

    @staticmethod
    def targets(relations: TokenRelations):
        return relations.prefix


class StatisticalInduction(Induction):
    """From ``t`` to the positions ``j <= t`` whose previous token equals ``x_t``."""

    name = "statistical_induction"
    colour = "tab:orange"
