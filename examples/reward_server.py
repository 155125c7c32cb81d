"""A reward-model server for ``task.reward: http://HOST:PORT/score`` (asyncrl.tasks.remote_reward).

    python examples/reward_server.py --model DIR --port 8000 [--host 127.0.0.1] [--token-file F]
    python examples/reward_server.py --make-tiny-model DIR      # a tiny random model, for tests

Serves any transformers ``AutoModelForSequenceClassification`` folder.
``POST /score`` takes ``{"prompts": [...], "responses": [...], "labels": [...]}``
(labels optional and unused: a learned reward model needs none) and
answers ``{"rewards": [...]}``. A sample's score is the logit of output
``--label-index`` (0; a reward model has ``num_labels=1``) at the last
token of the prompt + response, the model's own pooling; ``--sigmoid``
maps it to (0, 1). The text is the tokenizer's chat template over a user
turn (the prompt) and an assistant turn (the response) when the tokenizer
has one, else the prompt and response joined as they are. ``GET /health``
answers ``{"status": "ok", "requests": N, "samples": M}``, without a token.

Batching: request threads tokenize, then queue their samples; one model
thread takes everything queued (up to ``--max-batch-size`` samples a forward
pass) so concurrent requests share a forward pass. The queue is bounded
(``--max-queued-requests``): past it a request gets 503 at once and the
client backs off, instead of threads piling up. Inputs are right-padded; a
causal model's last real token does not attend to the padding after it, so
a batched score equals the sample's score alone.

Errors: a malformed request gets 400 ``{"error": ..., "field": ...}`` naming
the field; text the tokenizer cannot encode gets 422; a failed forward pass
500. Each is that request's alone; the server keeps serving.

Security: binds 127.0.0.1 by default. Any other host requires
``--token-file`` (a file holding one token), and then every ``/score``
request must carry ``Authorization: Bearer <token>``. Request bodies are
capped (``--max-request-bytes``) and idle connections time out.

Connections: HTTP/1.1, kept alive between requests (the asyncrl client keeps
its own open), so a generator does not pay a TCP handshake per group. A
refused request whose body was not read closes its connection: the unread
bytes would otherwise be taken for the next request.

Needs only the standard library, torch and transformers.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import queue
import sys
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from asyncrl.wire.ports import is_loopback_host

log = logging.getLogger("reward_server")


def read_token(path: str) -> str:
    """The bearer token in ``path``: one word, surrounding whitespace ignored."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path}: expected one token (no spaces)")
    return token


class BadRequest(Exception):
    """A request the server will not score; ``status`` and ``field`` go into the JSON error."""

    def __init__(self, message: str, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def parse_request(body: bytes) -> tuple[list[str], list[str]]:
    """``(prompts, responses)`` of a ``/score`` body, or :class:`BadRequest` naming the field at fault."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}", "body") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object", "body")
    lists = {}
    for key in ("prompts", "responses"):
        value = data.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise BadRequest(f"'{key}' must be a list of strings", key)
        lists[key] = value
    if len(lists["prompts"]) != len(lists["responses"]):
        raise BadRequest(f"{len(lists['prompts'])} prompts for {len(lists['responses'])} responses", "prompts")
    labels = data.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != len(lists["responses"])):
        raise BadRequest("'labels' must be a list with one entry per response", "labels")
    return lists["prompts"], lists["responses"]


class Scorer:
    """Tokenizes in the caller's thread and batches forward passes in one model thread."""

    def __init__(
        self,
        model_dir: str,
        *,
        label_index: int = 0,
        sigmoid: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_queued_requests: int = 64,
        max_length: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                model_dir, dtype="auto" if dtype == "auto" else getattr(torch, dtype)
            )
            .to(self.device)
            .eval()
        )
        if self.tokenizer.pad_token is None:  # many reward models pad with their end-of-sequence token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # a too long text keeps its end: the response being scored
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        num_labels = self.model.config.num_labels
        if not 0 <= label_index < num_labels:
            raise ValueError(f"--label-index {label_index}: the model has {num_labels} output(s)")
        self.label_index = label_index
        self.sigmoid = sigmoid
        self.max_batch_size = max_batch_size
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self._queue: queue.Queue[tuple[list[list[int]], Future]] = queue.Queue(max_queued_requests)
        self.requests = self.samples = 0
        threading.Thread(target=self._serve_forever, name="model", daemon=True).start()

    def encode(self, prompt: str, response: str) -> list[int]:
        """Token ids of one sample as the model reads it."""
        if self.chat:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            return self.tokenizer(
                text, add_special_tokens=False, truncation=bool(self.max_length), max_length=self.max_length
            ).input_ids
        return self.tokenizer(prompt + response, truncation=bool(self.max_length), max_length=self.max_length).input_ids

    def score(self, prompts: list[str], responses: list[str], timeout_s: float) -> list[float]:
        """Scores of the pairs, in order; BadRequest for text the tokenizer refuses or a full queue."""
        ids = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            try:
                ids.append(self.encode(prompt, response))
            except Exception as exc:  # noqa: BLE001 (tokenizers raise plain Exception)
                raise BadRequest(f"sample {i} cannot be tokenized: {exc}", "responses", status=422) from None
        if not ids:
            return []
        future: Future[list[float]] = Future()
        try:
            self._queue.put_nowait((ids, future))
        except queue.Full:
            raise BadRequest("the server is busy; retry later", None, status=503) from None
        return future.result(timeout=timeout_s)

    def forward(self, ids: list[list[int]]) -> list[float]:
        """One padded forward pass: the chosen logit (or its sigmoid) per sample."""
        torch = self.torch
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            logits = self.model(**batch).logits[:, self.label_index].float()
        return (torch.sigmoid(logits) if self.sigmoid else logits).tolist()

    def _serve_forever(self) -> None:
        while True:
            jobs = [self._queue.get()]
            queued = len(jobs[0][0])
            while queued < self.max_batch_size:  # whatever else waits joins this pass; nothing waits for more
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                queued += len(jobs[-1][0])
            flat = [x for ids, _ in jobs for x in ids]
            try:
                scores: list[float] = []
                for start in range(0, len(flat), self.max_batch_size):
                    scores += self.forward(flat[start : start + self.max_batch_size])
            except Exception as exc:
                log.exception("forward pass failed")
                for _, future in jobs:
                    future.set_exception(exc)
                continue
            self.requests += len(jobs)
            self.samples += len(flat)
            at = 0
            for ids, future in jobs:
                future.set_result(scores[at : at + len(ids)])
                at += len(ids)


def make_handler(
    scorer: Scorer, token: str | None, max_request_bytes: int, timeout_s: float
) -> type[BaseHTTPRequestHandler]:
    """The request handler class, bound to one scorer and its settings."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: every reply carries its Content-Length
        timeout = timeout_s  # an idle or trickling client loses its connection, not a thread forever

        def do_GET(self) -> None:
            if self.path.split("?")[0] == "/health":
                self._reply(200, {"status": "ok", "requests": scorer.requests, "samples": scorer.samples})
            else:
                self._reply(404, {"error": f"no such endpoint {self.path}; POST /score, GET /health"})

        def do_POST(self) -> None:
            body = None
            try:
                if self.path.split("?")[0] != "/score":
                    raise BadRequest(f"no such endpoint {self.path}; POST /score", None, status=404)
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    raise BadRequest("a Content-Length header is required", "Content-Length", status=411) from None
                if not 0 <= length <= max_request_bytes:
                    raise BadRequest(f"body over {max_request_bytes} bytes", "Content-Length", status=413)
                # read before any refusal: closing on unread bytes resets the connection, losing the reply
                body = self.rfile.read(length)
                if token is not None and not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()
                ):
                    raise BadRequest("missing or wrong bearer token", "Authorization", status=401)
                prompts, responses = parse_request(body)
                rewards = scorer.score(prompts, responses, timeout_s)
            except BadRequest as exc:
                if body is None:  # refused unread: the connection cannot carry another request
                    self.close_connection = True
                self._reply(exc.status, {"error": str(exc), "field": exc.field})
            except Exception as exc:  # noqa: BLE001 (one request fails, the server goes on)
                self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            else:
                self._reply(200, {"rewards": rewards})

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status == 503:
                self.send_header("Retry-After", "1")
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def make_tiny_model(out_dir: str, seed: int = 0) -> Path:
    """A random ``LlamaForSequenceClassification`` (one output) on the repo's tiny config, with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    tiny = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"
    config = AutoConfig.from_pretrained(tiny, num_labels=1)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a sequence-classification model folder")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free one (printed at start)")
    parser.add_argument("--host", default="127.0.0.1", help="a non-loopback host requires --token-file")
    parser.add_argument("--token-file", help="require 'Authorization: Bearer <the file's token>' on /score")
    parser.add_argument("--label-index", type=int, default=0, help="which output is the score")
    parser.add_argument("--sigmoid", action="store_true", help="score = sigmoid(logit), in (0, 1)")
    parser.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=32, help="samples per forward pass")
    parser.add_argument("--max-queued-requests", type=int, default=64, help="past it, 503 until there is room")
    parser.add_argument("--max-length", type=int, help="tokens per sample, cut from the left (default: the model's)")
    parser.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per connection read and per scoring wait")
    parser.add_argument("--make-tiny-model", metavar="DIR", help="write a tiny random reward model to DIR and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.make_tiny_model:
        print(make_tiny_model(args.make_tiny_model))
        return
    if not args.model:
        parser.error("--model is required")
    if not is_loopback_host(args.host) and not args.token_file:
        parser.error(f"--host {args.host} accepts remote peers: give --token-file too (or bind 127.0.0.1)")
    token = read_token(args.token_file) if args.token_file else None
    scorer = Scorer(
        args.model,
        label_index=args.label_index,
        sigmoid=args.sigmoid,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_queued_requests=args.max_queued_requests,
        max_length=args.max_length,
    )
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(scorer, token, args.max_request_bytes, args.timeout_s)
    )
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"serving {args.model} on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
