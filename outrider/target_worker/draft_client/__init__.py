"""The target's gRPC draft source: remote draft workers behind the engine's DraftSource.

    engine ── submit(updates) ──> RemoteDraftSource ── DraftRequest ══> draft worker 0
                                   │ routes each seq_id to one healthy ══> draft worker 1
    engine <── collect(ids, t) ─── │ worker (rendezvous hash, sticky) <══ DraftResponse
                                   └ one thread per worker: handshake, stream, receive, reconnect

The engine never waits past its round deadline: `collect` returns whatever valid trees came
in time, and a sequence without one decodes unspeculated that round. Everything that arrives
is checked (`proto.receive_trees`, plus the root token and the round); a bad tree is dropped
and counted, never raised.

Features travel as raw bytes in the handshake's dtype; with a `projected` feature spec the
engine applies the drafter's fc first and hands over H values per token.

One module per part, all under the one lock `RemoteDraftSource` holds:

    source.py      RemoteDraftSource: submit (record, route, open the round, send), collect
    routing.py     which worker drafts each sequence; when it is re-sent whole (re-sync)
    rounds.py      the open rounds, the trees that arrive for them (checked), collect
    spec_cache.py  the speculation cache's target side: trees pushed before their round
    transport.py   channels (TLS, token), one thread per worker, the stream, reconnection
    handshake.py   fingerprints, the target's handshake, the features all workers agree on
    config.py      DraftClientConfig, ClientTls, DraftClientCounters
"""

from outrider.target_worker.draft_client.config import ClientTls, DraftClientConfig, DraftClientCounters
from outrider.target_worker.draft_client.handshake import target_handshake, tokenizer_fingerprint
from outrider.target_worker.draft_client.source import RemoteDraftSource

__all__ = [
    "ClientTls",
    "DraftClientConfig",
    "DraftClientCounters",
    "RemoteDraftSource",
    "target_handshake",
    "tokenizer_fingerprint",
]
