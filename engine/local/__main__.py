"""``python -m engine.local``: serve the MinT-compatible API standalone.

Prints exactly one line on stdout once requests are accepted::

    engine.local: serving <model_name> at http://127.0.0.1:<port>

(launchers wait for it); logs go to stderr, and so does, before it, where the server keeps
its data: ``default_data_dir()`` unless ``--data-dir`` says otherwise; ``--ephemeral``
uses a temporary dir and says at start and at stop that it is deleted. SIGINT/SIGTERM
stop it cleanly. Exit codes:
0 stopped; 2 a bad option, or the ``local`` extra is not installed (one line: ``pip
install 'engine[local]'``); 1 the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

import anyio

from engine.basemodels.catalogue import DEFAULT_MODEL_DIR, PACKAGED, PRETRAINED
from engine.common.cli import add_version_flag, program_name
from engine.common.extras import missing_message
from engine.local.config import (
    DEFAULT_DATA_DIR_TEXT,
    READY_PREFIX,
    SAMPLING_LOGPROBS,
    Limits,
    ServerConfig,
    default_data_dir,
    make_config,
)
from engine.local.faults import FaultSpecError
from engine.local.latency import LatencyProfileError
from engine.local.profiles import HOSTED_SAMPLING_SLOTS, SERVICES

GIL_SWITCH_INTERVAL_S = 0.001
"""The server's event loop shares the GIL with its compute and sampler threads, whose
torch ops give it up and take it back all the time; a thread waiting for it forces a
switch only after the interval (5 ms by default), so every step of reading a request
could wait that long behind them. At 32x8x16 a step's sample requests were read up to
~45 ms after they were sent; 1 ms brought the pace from 1.34 to 1.16 cycles/step over
six interleaved pairs (docs/performance.md, item 15)."""

_EPILOG = """\
fault spec (--faults): comma-separated rules KIND[~PHASE][@ENDPOINT|...]:TRIGGER and options
  KIND     500 503 429 408 drop slow (HTTP level), 410 (retrieve_future), fail (the future fails)
  PHASE    before (default: the request is not applied) | after (applied, answer lost)
  TRIGGER  a rate in [0,1], or at=N+M (the N-th and M-th matching requests)
  options  seed=INT  slow_s=SECONDS  retry_after_s=SECONDS
  e.g.     "seed=1,500:0.02,429:0.02,drop~after@forward_backward|optim_step:0.02,410@asample:0.05"

latency profile (--latency): off | mint[:KEY=VALUE,...] | KEY=VALUE,...
  KEY      cycle_s gather_s sample_request_s sample_token_s snapshot_s scale
  mint     10 s clock cycles, scale 0.05 (a cycle lasts 0.5 s); e.g. "mint:scale=0.02"

environment: ENGINE_LOCAL_API_KEY is used when --api-key is not given.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _slots(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..4096, got {text!r}")
    return value


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 of ``unit``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0, got {text!r}")
        return value

    return parse


_positive_rate = _positive("requests per second")
_positive_seconds = _positive("seconds")


class _Parser(argparse.ArgumentParser):
    """Reports a bad option or value as ONE line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=program_name("engine.local", "engine-local"),
        description="Serve a MinT/Tinker-compatible LoRA training API on a local model, "
        "for the unmodified mint SDK (set MINT_BASE_URL to the printed URL).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default=ServerConfig.host,
        help="address to bind (default 127.0.0.1; a non-loopback address requires --api-key)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=ServerConfig.port,
        help="port to bind; 0 picks a free one (default 0)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR|NAME",
        help="local Hugging Face causal-LM directory, or a packaged model by name: "
        f"{', '.join(PACKAGED)}, or a pretrained one: {', '.join(PRETRAINED)} (opt-in, see "
        f"docs/local-server.md) (default tiny-arith, {DEFAULT_MODEL_DIR})",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="base_model name clients use (default: chosen by the backend from the model)",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="extra base_model name accepted for the served model, e.g. Qwen/Qwen3-0.6B "
        "(repeatable), so scripts with a hard-coded hosted model run unchanged",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require this key (X-API-Key, raw or as a JWT from auth/token, which only the key "
        "itself can fetch); default: "
        "$ENGINE_LOCAL_API_KEY, else no authentication (any key works)",
    )
    data = parser.add_mutually_exclusive_group()
    data.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where training runs and checkpoints are kept, across restarts "
        f"(default: {DEFAULT_DATA_DIR_TEXT})",
    )
    data.add_argument(
        "--ephemeral",
        action="store_true",
        help="keep them in a temporary dir instead, deleted with every checkpoint in it when "
        "the server stops",
    )
    parser.add_argument("--faults", default=None, metavar="SPEC", help="inject faults (see below)")
    parser.add_argument(
        "--latency", default=None, metavar="PROFILE", help="simulate hosted latency (see below)"
    )
    parser.add_argument(
        "--long-poll",
        type=float,
        default=ServerConfig.long_poll_s,
        metavar="SECONDS",
        help="how long retrieve_future holds a poll before try_again (default 20)",
    )
    limits = Limits()
    parser.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=limits.max_body_bytes,
        metavar="N",
        help="largest JSON request body in bytes (uploads: --max-upload-bytes), 413 beyond "
        f"(default {limits.max_body_bytes})",
    )
    parser.add_argument(
        "--max-upload-bytes",
        type=_positive_int,
        default=limits.max_upload_bytes,
        metavar="N",
        help="largest checkpoint archive upload in bytes, and the most file contents it may "
        f"unpack to; 413 beyond (default {limits.max_upload_bytes})",
    )
    parser.add_argument(
        "--max-datums",
        type=_positive_int,
        default=limits.max_datums,
        metavar="N",
        help="datums per forward/forward_backward request; the SDK sends at most 1024 "
        f"(default {limits.max_datums})",
    )
    parser.add_argument(
        "--max-request-tokens",
        type=_positive_int,
        default=limits.max_request_tokens,
        metavar="N",
        help="model_input tokens per forward/forward_backward request, bounding how long one "
        f"request holds the compute thread (default {limits.max_request_tokens})",
    )
    parser.add_argument(
        "--max-seq-gap",
        type=_positive_int,
        default=limits.max_seq_gap,
        metavar="N",
        help="how far a model's seq_id may run past the first missing one; further ones are "
        f"refused at once (default {limits.max_seq_gap})",
    )
    parser.add_argument(
        "--seq-gap-timeout",
        type=_positive_seconds,
        default=ServerConfig.seq_gap_timeout_s,
        metavar="SECONDS",
        help="how long an operation waits for a missing earlier seq_id of its model before "
        f"it is refused (default {ServerConfig.seq_gap_timeout_s:g})",
    )
    parser.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=ServerConfig.header_timeout_s,
        metavar="SECONDS",
        help="a connection that has not sent a request's headers within this time is closed "
        f"(default {ServerConfig.header_timeout_s:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=ServerConfig.body_timeout_s,
        metavar="SECONDS",
        help="a request whose body (a checkpoint upload's too) has not arrived within this "
        "time gets 408 "
        f"(default {ServerConfig.body_timeout_s:g})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads for the model (default: 1 for small models, all cores but "
        "one otherwise; on a busy machine 1 is often fastest)",
    )
    parser.add_argument(
        "--sampling-logprobs",
        choices=SAMPLING_LOGPROBS,
        default=ServerConfig.sampling_logprobs,
        help="the logprob reported for each sampled token: under the distribution it was "
        "drawn from ('tempered', the default, as hosted Tinker) or under the untempered "
        "model ('untempered'); see docs/losses.md",
    )
    parser.add_argument(
        "--service",
        choices=SERVICES,
        default=ServerConfig.service,
        help="behave as this hosted service in what changes a client's results or control "
        "flow: accepted losses and loss_fn_config keys, MinT's rollout_correction_config, "
        "the sampling queue; see docs/local-server.md, 'Service profiles' (default local: "
        "every option of this server)",
    )
    parser.add_argument(
        "--sampling-slots",
        type=_slots,
        default=None,
        metavar="N",
        help="sample requests run at a time; the rest wait in a FIFO queue, and a request "
        "sent with X-Tinker-Sampling-Backpressure: 1 gets 408 with its place in it while it "
        f"waits; 0: no limit (default: no limit for local, {HOSTED_SAMPLING_SLOTS} for mint "
        "and tinker)",
    )
    parser.add_argument(
        "--sampling-queue",
        type=_positive_int,
        default=limits.max_queued_samples,
        metavar="N",
        help="sample requests that may wait for a slot; beyond it a new one gets 429 "
        f"(default {limits.max_queued_samples})",
    )
    parser.add_argument(
        "--rate-limit",
        type=_positive_rate,
        default=None,
        metavar="PER_SECOND",
        help="requests per second per API key (token bucket, bursts of max(1, rate)); past it "
        "429 with Retry-After; polls and heartbeats are not counted (default: no limit)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=ServerConfig.session_timeout_s,
        metavar="SECONDS",
        help="release the training clients and sampling sessions of a session that sent "
        "no heartbeat for this long (default 600; the SDK heartbeats every 10 s)",
    )
    parser.add_argument(
        "--max-models",
        type=int,
        default=limits.max_models,
        metavar="N",
        help="training clients held in memory; beyond it a new one is refused (429), a live "
        f"one is never evicted for it (default {limits.max_models})",
    )
    parser.add_argument(
        "--max-samplers",
        type=int,
        default=limits.max_named_samplers,
        metavar="N",
        help="checkpoint snapshots (sampling clients from a model_path, and those saved with "
        "save_weights_for_sampler) held in memory, and as many from "
        "save_weights_and_get_sampling_client; beyond it the least recently used one that no "
        "live client may still sample from is evicted (never a training client's newest, nor "
        "one being sampled); if there is none, the new one is refused (429) "
        f"(default {limits.max_named_samplers})",
    )
    parser.add_argument(
        "--max-adapter-memory",
        type=int,
        default=limits.max_adapter_bytes >> 20,
        metavar="MB",
        help="memory for training clients and sampler snapshots together; beyond it the "
        "least recently used are evicted, snapshots first "
        f"(default {limits.max_adapter_bytes >> 20})",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="stderr log level (default warning)",
    )
    add_version_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    no_server = missing_message("local", "the local server")
    if no_server is not None:
        print(f"{parser.prog}: error: {no_server}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        limits = Limits(
            max_body_bytes=args.max_body_bytes,
            max_upload_bytes=args.max_upload_bytes,
            max_datums=args.max_datums,
            max_request_tokens=args.max_request_tokens,
            max_seq_gap=args.max_seq_gap,
            max_models=args.max_models,
            max_named_samplers=args.max_samplers,
            max_ephemeral_samplers=args.max_samplers,
            max_adapter_bytes=args.max_adapter_memory << 20,
            max_queued_samples=args.sampling_queue,
        )
        config = make_config(
            args.model,
            api_key=args.api_key or os.environ.get("ENGINE_LOCAL_API_KEY") or None,
            data_dir=None if args.ephemeral else args.data_dir or default_data_dir(),
            host=args.host,
            port=args.port,
            faults=args.faults,
            latency=args.latency,
            model_name=args.model_name,
            model_aliases=args.model_alias,
            long_poll_s=args.long_poll,
            seq_gap_timeout_s=args.seq_gap_timeout,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            session_timeout_s=args.session_timeout,
            sampling_logprobs=args.sampling_logprobs,
            num_threads=args.threads,
            limits=limits,
            service=args.service,
            sampling_slots=args.sampling_slots,
            rate_limit=args.rate_limit,
        )
    except (ValueError, FaultSpecError, LatencyProfileError) as exc:
        parser.error(str(exc))
    if config.data_dir is not None:
        try:
            config.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--data-dir {config.data_dir}: cannot create it ({exc.strerror})")

    # Imported only now: torch and transformers take seconds, --help and bad options don't.
    from engine.local.compute_types import BackendError
    from engine.local.launch import serve_local

    async def run() -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with serve_local(config=config) as server:
                # Everything alive now (torch, the model, the app) lives as long as the
                # server: keep it out of the collector's full passes, which otherwise
                # stall every thread for 0.1-0.25 s now and then while training runs.
                gc.collect()
                gc.freeze()
                data_dir = server.data_dir
                if args.ephemeral:
                    _say(
                        f"WARNING: data dir {data_dir} is temporary (--ephemeral): every "
                        "checkpoint in it is deleted when the server stops"
                    )
                else:
                    _say(f"data dir {data_dir} (kept when the server stops)")
                print(f"{READY_PREFIX}{server.model_name} at {server.base_url}", flush=True)
                async for _ in signals:
                    break
        if args.ephemeral:
            _say(f"deleted the temporary data dir {data_dir} and its checkpoints (--ephemeral)")

    try:
        anyio.run(run)
    except ValueError as exc:  # e.g. the port is taken
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:  # the model directory cannot be loaded
        print(f"{parser.prog}: error: cannot load the model: {exc}", file=sys.stderr)
        return 1
    return 0


def _say(message: str) -> None:
    print(f"engine.local: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
