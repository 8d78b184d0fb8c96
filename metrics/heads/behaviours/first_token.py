"""First-token heads: attention parked on the first position (the BOS sink)."""

from metrics.heads.behaviours.base import Behaviour, TokenRelations


class FirstToken(Behaviour):
    """``{0}`` for ``q >= 1``."""

    name = "first_token"
    colour = "tab:brown"

    @staticmethod
    def targets(relations: TokenRelations):
        return relations.positional((relations.key == 0) & (relations.query >= 1))
