"""Duplicate-token heads: from each token to its earlier occurrences (Wang et al. 2022, "Interpretability
in the Wild")."""

from metrics.heads.behaviours.base import Behaviour, TokenRelations


class DuplicateToken(Behaviour):
    """``{j < q : x_j = x_q}``."""

    name = "duplicate_token"
    key = "duplicate"  # heads/duplicate/LxHy
    colour = "tab:olive"

    @staticmethod
    def targets(relations: TokenRelations):
        return relations.same & (relations.key < relations.query)[None]
