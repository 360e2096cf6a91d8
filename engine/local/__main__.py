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
import os
import signal
import sys
from typing import NoReturn

import anyio

from engine.common.cli import add_version_flag, program_name
from engine.common.extras import missing_message
from engine.local.config import (
    READY_PREFIX,
    ServerConfig,
    add_server_flags,
    default_data_dir,
    flag_values,
)

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


class _Parser(argparse.ArgumentParser):
    """Reports a bad option or value as ONE line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The flags of every setting (:func:`engine.local.config.add_server_flags`), and the
    command's own: ``--ephemeral`` (instead of ``--data-dir``) and ``--log-level``."""
    parser = _Parser(
        prog=program_name("engine.local", "engine-local"),
        description="Serve a MinT/Tinker-compatible LoRA training API on a local model, "
        "for the unmodified mint SDK (set MINT_BASE_URL to the printed URL).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = parser.add_mutually_exclusive_group()
    add_server_flags(parser, {"data_dir": data})
    data.add_argument(
        "--ephemeral",
        action="store_true",
        help="keep them in a temporary dir instead, deleted with every checkpoint in it when "
        "the server stops",
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
        values = flag_values(args, os.environ)
        if not args.ephemeral:
            values.setdefault("data_dir", default_data_dir())
        config = ServerConfig(**values)
    except ValueError as exc:  # a bad setting, a --faults spec's...
        parser.error(str(exc))
    if config.data_dir is not None:
        try:
            config.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--data-dir {config.data_dir}: cannot create it ({exc.strerror})")

    # Imported only now: torch and transformers take seconds, --help and bad options don't.
    from engine.local.compute.backend_types import BackendError
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
