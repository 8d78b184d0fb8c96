"""Previous-token heads: from each query to the position before it (Olsson et al. 2022)."""

from metrics.heads.behaviours.base import Behaviour, TokenRelations


class PreviousToken(Behaviour):
    """``{q - 1}`` for ``q >= 1``."""

    name = "previous_token"
    key = "prev_token"  # heads/prev_token/LxHy
    colour = "tab:blue"

    @staticmethod
    def targets(relations: TokenRelations):
        return relations.positional(relations.key == relations.query - 1)
