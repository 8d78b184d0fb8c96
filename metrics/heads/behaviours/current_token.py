"""Current-token heads: each query attends to itself."""

from metrics.heads.behaviours.base import Behaviour, TokenRelations


class CurrentToken(Behaviour):
    """``{q}``."""

    name = "current_token"
    colour = "tab:purple"

    @staticmethod
    def targets(relations: TokenRelations):
        return relations.positional(relations.key == relations.query)
