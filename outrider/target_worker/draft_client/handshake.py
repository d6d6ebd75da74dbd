"""Who the target is, and which features every draft worker must agree on.

At connect the target sends its handshake (model id, vocabulary fingerprint, shape, limits);
`proto.check_handshake` refuses a mismatched pair. The worker answers with the features it
wants each update to carry and, for a `projected` spec, the sha256 of its fc, which the
client fetches once per distinct digest. The engine captures one set of features per round
for every sequence, whichever worker drafts it, so all workers must want the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from outrider.proto import (
    FeatureSpec,
    HandshakeMismatchError,
    HandshakeRequest,
    HandshakeResponse,
    InvalidDraftError,
    Limits,
    join_projection,
    vocab_fingerprint,
)
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """`vocab_fingerprint` of a `tokenizer.json` folder; draft and target must call the same."""
    from tokenizers import Tokenizer

    return vocab_fingerprint(Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab())


def target_handshake(
    model_dir: str | Path, tokenizer_dir: str | Path, *, model_id: str, limits: Limits, method: str = ""
) -> HandshakeRequest:
    """The handshake a target serving the Hugging Face folder `model_dir` sends at connect."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return HandshakeRequest(
        target_model_id=model_id,
        vocab_size=config["vocab_size"],
        vocab_fingerprint=tokenizer_fingerprint(tokenizer_dir),
        target_num_layers=config["num_hidden_layers"],
        target_hidden_size=config["hidden_size"],
        limits=limits,
        method=method,
    )


class FeatureAgreement:
    """The features (and fc) the draft workers want: the configured spec until the first
    accepted handshake fixes it; a later worker that wants others is refused.

    Written on the connection threads under the client's lock, read under it by `submit`.
    """

    def __init__(self, expected: FeatureSpec):
        self.spec = expected
        self.projection: torch.Tensor | None = None  # the drafters' fc, for a projected spec
        self.projection_sha256 = ""
        self.agreed = False  # set by the first accepted handshake

    def fetch_projection(
        self,
        stub: pb_grpc.DraftServiceStub,
        response: HandshakeResponse,
        metadata: tuple | None,
        *,
        max_message_bytes: int,
        connect_timeout_s: float,
    ) -> torch.Tensor | None:
        """The worker's fc for a projected spec (fetched once per distinct sha256); else None."""
        if not response.features.projected:
            return None
        if response.projection_sha256 == self.projection_sha256:
            return self.projection
        chunk = min(1 << 20, max_message_bytes // 2)
        # Real projections are large (Llama-8B: 4096 x 12288 float32 = 200 MB): allow a minute.
        chunks = stub.FeatureProjection(
            pb.FeatureProjectionRequest(max_chunk_bytes=chunk),
            timeout=max(60.0, connect_timeout_s),
            metadata=metadata,
        )
        try:
            return join_projection(list(chunks), response.projection_sha256)
        except InvalidDraftError as error:
            raise HandshakeMismatchError([f"feature projection: {error}"]) from None

    def agree(self, address: str, response: HandshakeResponse, projection: torch.Tensor | None) -> None:
        """Adopt the worker's features, or refuse it if they differ from the agreed ones (under the lock)."""
        features, sha256 = response.features, response.projection_sha256
        if self.agreed and (features, sha256) != (self.spec, self.projection_sha256):
            raise HandshakeMismatchError(
                [
                    f"features: {address} wants {features} (projection {sha256[:12] or 'none'}), "
                    f"the other draft workers {self.spec} "
                    f"(projection {self.projection_sha256[:12] or 'none'})"
                ]
            )
        self.spec, self.agreed = features, True
        self.projection, self.projection_sha256 = projection, sha256
