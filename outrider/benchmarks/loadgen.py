"""A bounded load generator for an Outrider server on this machine (loopback only).

`LoadGenerator.run(phases)` keeps `phase.concurrency` clients busy for `phase.seconds` each,
then stops by itself: no request starts after the last phase ends, and every request has a
timeout. Each client sends `/v1/completions` requests drawn from a `LoadMix` (streamed or
whole, greedy or sampled, a short or a long prompt, and now and then a client that hangs
up after its first chunk) and records one `RequestRecord` per request: latency, time to
first token, tokens, and, for greedy ones, whether the text equals the reference (the
server's own uninterrupted answer, measured at concurrency 1 before the run).

Only the standard library's `http.client`, so it runs wherever the server does; it refuses
any host other than the loopback address.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Phase:
    seconds: float
    concurrency: int  # clients sending back-to-back requests during the phase


@dataclass(frozen=True)
class LoadMix:
    stream_share: float = 0.5  # requests streamed (SSE); the rest are whole
    sampled_share: float = 0.0  # requests at temperature 1 (not checked for exactness)
    long_prompt_share: float = 0.0  # requests with a long prompt (the prompt repeated)
    disconnect_share: float = 0.0  # streamed requests whose client hangs up after the first chunk


@dataclass
class RequestRecord:
    start: float  # seconds since the run began
    latency_s: float
    ok: bool  # answered in full (a hang-up by our own client counts as ok once it got a chunk)
    kind: str  # "stream" | "whole" | "disconnect"
    greedy: bool
    tokens: int = 0
    ttft_s: float | None = None
    wrong: bool = False  # greedy and the text differs from the reference
    error: str = ""
    itl_s: list[float] = field(default_factory=list)  # streamed: gaps between chunks carrying text
    # streamed: (seconds since the run began, completion tokens so far) at each chunk, from the
    # server's usage in every chunk (vLLM's `continuous_usage_stats`); empty where it sent none
    token_times: list[tuple[float, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class LoadGenerator:
    """Clients against `base_url` (an application's prefix, e.g. http://127.0.0.1:8000/app)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        prompts: list[str],
        max_tokens: int,
        mix: LoadMix | None = None,
        reference: dict[str, str] | None = None,
        long_prompt_repeat: int = 4,
        seed: int = 0,
        timeout_s: float = 120.0,
        ignore_eos: bool = False,
    ):
        url = urlparse(base_url)
        if url.hostname not in LOOPBACK:
            raise ValueError(f"the load generator only drives a server on this machine, not {url.hostname}")
        self.host, self.port, self.prefix = url.hostname, url.port or 80, url.path.rstrip("/")
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens
        self.mix, self.reference = mix or LoadMix(), dict(reference or {})
        self.long_prompt_repeat, self.timeout_s = long_prompt_repeat, timeout_s
        # Every answer runs to max_tokens (vLLM's benchmark --ignore-eos): sampled answers that
        # stop at EOS at different lengths weigh each request's TTFT differently.
        self.ignore_eos = ignore_eos
        self.rng = random.Random(seed)
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ one request

    def request(self, prompt: str, *, stream: bool, greedy: bool, disconnect: bool = False) -> RequestRecord:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body |= {"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": self.rng.randrange(1 << 30)}
        if stream:
            options = {"include_usage": True, "continuous_usage_stats": True}
            body |= {"stream": True, "stream_options": options}
        kind = "disconnect" if disconnect else ("stream" if stream else "whole")
        start = time.monotonic()
        record = RequestRecord(start - self._t0, 0.0, False, kind, greedy)
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            connection.request(
                "POST",
                f"{self.prefix}/v1/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            response = connection.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {response.read()[:200]!r}"
                return record
            text = (
                self._read_stream(response, record, start, disconnect)
                if stream
                else self._read_whole(response, record)
            )
            if text is None:
                return record
            record.ttft_s = record.ttft_s if stream else time.monotonic() - start
            record.ok = True
            if greedy and not disconnect and prompt in self.reference:
                record.wrong = text != self.reference[prompt]
        except Exception as error:  # a dropped connection, a timeout: a failed request, recorded
            record.error = f"{type(error).__name__}: {error}"
        finally:
            record.latency_s = time.monotonic() - start
            connection.close()
            with self._lock:
                self.records.append(record)
        return record

    def _read_whole(self, response, record: RequestRecord) -> str | None:
        answer = json.loads(response.read())
        record.tokens = answer["usage"]["completion_tokens"]
        return answer["choices"][0]["text"]

    def _read_stream(self, response, record: RequestRecord, start: float, disconnect: bool) -> str | None:
        parts: list[str] = []
        last = start  # when the last chunk carrying text arrived
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                return "".join(parts)
            event = json.loads(payload)
            if "error" in event:  # reported in-band after the 200
                record.error = f"in-band: {event['error'].get('message', '')[:200]}"
                return None
            if event.get("usage"):
                record.tokens = event["usage"]["completion_tokens"]
                record.token_times.append((time.monotonic() - self._t0, record.tokens))
            for choice in event.get("choices", []):
                if choice.get("text"):
                    now = time.monotonic()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    parts.append(choice["text"])
                    if disconnect:  # hang up mid-stream: the server must free the sequence
                        return "".join(parts)
        record.error = "the stream ended without [DONE]"
        return None

    # ------------------------------------------------------------------ the run

    def draw(self) -> tuple[str, dict]:
        """The next request: its prompt and `request` keyword arguments, from the mix."""
        with self._lock:
            prompt = self.rng.choice(self.prompts)
            long = self.rng.random() < self.mix.long_prompt_share
            stream = self.rng.random() < self.mix.stream_share
            greedy = self.rng.random() >= self.mix.sampled_share
            disconnect = stream and self.rng.random() < self.mix.disconnect_share
        if long:
            prompt = prompt * self.long_prompt_repeat
        return prompt, {"stream": stream, "greedy": greedy, "disconnect": disconnect}

    def run(self, phases: list[Phase], on_phase=None) -> list[RequestRecord]:
        """Drive `phases` in order; returns every request's record once all have ended."""
        self._t0 = time.monotonic()
        ends, at = [], 0.0
        for phase in phases:
            at += phase.seconds
            ends.append(at)
        wanted = [0]  # clients that should be busy now

        def client(index: int) -> None:
            while True:
                now = time.monotonic() - self._t0
                if now >= ends[-1]:
                    return
                if index >= wanted[0]:
                    time.sleep(0.1)
                    continue
                prompt, kwargs = self.draw()
                self.request(prompt, **kwargs)

        clients = [
            threading.Thread(target=client, args=(i,), daemon=True)
            for i in range(max(p.concurrency for p in phases))
        ]
        for thread in clients:
            thread.start()
        for index, phase in enumerate(phases):
            wanted[0] = phase.concurrency
            if on_phase is not None:
                on_phase(index, phase, time.monotonic() - self._t0)
            time.sleep(max(0.0, ends[index] - (time.monotonic() - self._t0)))
        for thread in clients:
            thread.join(self.timeout_s + 5)
        return list(self.records)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
