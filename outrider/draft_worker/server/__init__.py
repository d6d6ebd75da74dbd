"""The draft server: one proposer behind `outrider.v1.DraftService`, shared by many targets.

    target A ══ Draft stream ══> reader A ─┐                      ┌─> outbox A ══> target A
    target B ══ Draft stream ══> reader B ─┼─> pending ─> drafting loop ─┼─> outbox B ══> target B
                                           ┘   (one thread: one       └─> ...
                                                propose() per batch)

    batcher.py     DraftBatcher: the drafting loop, stream ids, the speculation cache's hooks
    streams.py     Stream and StreamLimits: what one target may make the server hold
    servicer.py    DraftServicer: the DraftService methods, one reader thread per stream
    auth.py        ServerTls and TokenInterceptor: who may connect
    bootstrap.py   serve() and DraftServer: the gRPC server with health and reflection

The speculation cache the batcher drives lives in `draft_worker.speculation`; the command
line (`outrider draft-server`) in `draft_worker.server_cli`.
"""

from outrider.draft_worker.server.auth import ServerTls, TokenInterceptor
from outrider.draft_worker.server.batcher import DraftBatcher, DraftIdentity, ServerStats
from outrider.draft_worker.server.bootstrap import DRAFT_SERVICE, DraftServer, serve
from outrider.draft_worker.server.servicer import DraftServicer
from outrider.draft_worker.server.streams import StreamError, StreamLimits

__all__ = [
    "DRAFT_SERVICE",
    "DraftBatcher",
    "DraftIdentity",
    "DraftServer",
    "DraftServicer",
    "ServerStats",
    "ServerTls",
    "StreamError",
    "StreamLimits",
    "TokenInterceptor",
    "serve",
]
