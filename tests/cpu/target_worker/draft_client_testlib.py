"""Shared by the draft-client tests: the tiny target, prompts, plain references, servers.

`generate` runs prompts through the real step engine, with or without a draft source.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from outrider.draft_worker.server import DraftIdentity, serve
from outrider.draft_worker.server_cli import build_server_proposer
from outrider.proto import HandshakeRequest, Limits, TreeBudget
from outrider.proto import outrider_pb2 as pb
from outrider.proto import outrider_pb2_grpc as pb_grpc
from outrider.target_worker import draft_client
from outrider.target_worker.draft_client import DraftClientConfig, RemoteDraftSource, tokenizer_fingerprint
from outrider.target_worker.draft_source import DraftSource
from outrider.target_worker.engine import Engine, EngineStats
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

SNIPPETS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "import os\nimport sys\n\nfor name in os.listdir(path):\n    if name.endswith('.py'):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "    if value is None:\n        return None\n    if value is None:\n        raise",
]
MAX_NEW_TOKENS = 24
OPTIONS = {"num_speculative_tokens": 4}
BUDGET = TreeBudget(max_nodes=8, max_depth=4, top_k=2)


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    source: DraftSource | None = None,
    max_tokens: int = MAX_NEW_TOKENS,
    timeout_s: float | None = None,
) -> tuple[list[list[int]], EngineStats]:
    """Greedy outputs of all prompts, run concurrently; `source` None = speculation off."""
    engine = Engine(
        runner, source, eos_token_id=None, max_batch=16, tree_budget=BUDGET, draft_timeout_s=timeout_s
    )
    completions = engine.generate(prompts, RequestParams(max_tokens=max_tokens, ignore_eos=True))
    return [c.token_ids for c in completions], engine.stats


def load_runner(target_dir: Path) -> ModelRunner:
    return ModelRunner.from_pretrained(target_dir, max_model_len=512, kv_cache_rows=8 * 512)


def encode_prompts(tokenizer_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in SNIPPETS]


def target_handshake(family, **changes) -> HandshakeRequest:
    limits = Limits(max_batch=64, max_nodes=16, max_depth=8, max_top_k=4)
    request = draft_client.target_handshake(
        family.target_dir, family.tokenizer_dir, model_id="demo-tiny-target", limits=limits
    )
    return dataclasses.replace(request, **changes)


def start_server(family, method: str = "ngram", address: str = "127.0.0.1:0", proposer=None, **kw):
    proposer = proposer or build_server_proposer(
        method, dict(OPTIONS), family.draft_dir, family.tokenizer_dir
    )
    identity = DraftIdentity(
        f"test-{method}", proposer.vocab_size, tokenizer_fingerprint(family.tokenizer_dir)
    )
    return serve(proposer, identity, address=address, **kw)


def client(family, addresses: list[str], **config) -> RemoteDraftSource:
    defaults = dict(round_deadline_s=1.0, backoff_initial_s=0.02, backoff_max_s=0.2, connect_timeout_s=1.0)
    return RemoteDraftSource(addresses, target_handshake(family), DraftClientConfig(**(defaults | config)))


class DelayedProposer:
    """A proposer that takes `delay_s` longer per batch: a slow or overloaded draft worker."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.method, self.config, self.vocab_size = inner.method, inner.config, inner.vocab_size
        self.feature_spec = inner.feature_spec

    def propose(self, updates):
        time.sleep(self.delay_s)
        return self.inner.propose(updates)


class StopAfter(DraftSource):
    """Passes through to `source`, and calls `action` once when round `round` is collected."""

    def __init__(self, source: RemoteDraftSource, round: int, action):
        self.source, self.round, self.action, self.rounds = source, round, action, 0

    @property
    def feature_spec(self):
        return self.source.feature_spec

    def submit(self, updates):
        self.source.submit(updates)

    def collect(self, seq_ids, timeout_s=None):
        self.rounds += 1
        if self.rounds == self.round:
            self.action()
        return self.source.collect(seq_ids, timeout_s)


class ScriptedDrafter(pb_grpc.DraftServiceServicer):
    """A misbehaving draft worker: `reply(update) -> [pb.CandidateTree]` decides each answer."""

    def __init__(self, handshake: pb.HandshakeResponse, reply):
        self.handshake, self.reply = handshake, reply

    def Handshake(self, request, context) -> pb.HandshakeResponse:
        return self.handshake

    def Draft(self, request_iterator, context) -> Iterator[pb.DraftResponse]:
        for request in request_iterator:
            yield pb.DraftResponse(trees=[tree for update in request.updates for tree in self.reply(update)])


def start_scripted(drafter: ScriptedDrafter) -> tuple[grpc.Server, int]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DraftServiceServicer_to_server(drafter, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def honest_handshake(request: HandshakeRequest, **changes) -> pb.HandshakeResponse:
    fields = dict(
        protocol_version=pb.PROTOCOL_VERSION_1,
        draft_model_id="scripted",
        vocab_size=request.vocab_size,
        vocab_fingerprint=request.vocab_fingerprint,
        method="scripted",
        limits=request.limits.to_proto(),
    )
    return pb.HandshakeResponse(**(fields | changes))


def garbage_trees(update: pb.SequenceUpdate, vocab: int) -> list[pb.CandidateTree]:
    """Every kind of broken tree, plus a well-formed one rooted at the wrong token."""
    root = update.new_tokens[-1]
    common = dict(seq_id=update.seq_id, round=update.round, sampling=pb.DRAFT_SAMPLING_DETERMINISTIC)
    choice = update.round % 4
    if choice == 0:  # a cycle
        return [pb.CandidateTree(tokens=[root, 1, 2], parents=[-1, 2, 1], **common)]
    if choice == 1:  # out of the vocabulary
        return [pb.CandidateTree(tokens=[root, vocab + 7], parents=[-1, 0], **common)]
    if choice == 2:  # wrong root: looks fine, drafts from a context the target does not have
        return [pb.CandidateTree(tokens=[(root + 1) % vocab, 3], parents=[-1, 0], **common)]
    noisy = torch.rand(3).tolist()  # q that sums past one, in a sampled tree
    return [
        pb.CandidateTree(
            seq_id=update.seq_id,
            round=update.round,
            tokens=[root, 5],
            parents=[-1, 0],
            q_nodes=[0],
            q_top_k=3,
            q_token_ids=[5, 6, 7],
            q_probs=[x + 1.0 for x in noisy],
            sampling=pb.DRAFT_SAMPLING_WITH_REPLACEMENT,
        )
    ]
