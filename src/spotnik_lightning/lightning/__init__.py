"""Lightning integration (issue 3, in progress): so far the elastic data cursor."""

from spotnik_lightning.lightning.data import ElasticCursor

__all__ = ["ElasticCursor"]
