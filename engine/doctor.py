"""``python -m engine.doctor URL``: what a Tinker-compatible server supports of what the
engine can use, probed with tiny calls (docs/doctor.md).

Prints a table (``--json``: one JSON object). Exit 0 once probing finished, whatever
the server lacks; 2 on bad input; 1 when nothing answers at the URL. The probes are
:mod:`engine.session.capabilities`'s, the ones a run checks before its first sample.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from engine.common.cli import OneLineErrorParser, add_version_flag, program_name
from engine.common.sdks import choose_sdk
from engine.config import EngineConfig
from engine.errors import ConfigError, EngineError
from engine.redact import register_secret
from engine.session.capabilities import PROBE_TIMEOUT_S, Finding
from engine.session.doctor_probes import NoServerAnswers, probe_server


def _parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.doctor", "engine-doctor"),
        description="Probe a Tinker-compatible server for each capability the engine can "
        "use (tiny calls on a throwaway LoRA) and print what it supports.",
    )
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--api-key",
        help="API key (default: MINT_API_KEY or TINKER_API_KEY; prefer the environment)",
    )
    parser.add_argument("--base-model", help="the model to probe (default: the server's)")
    parser.add_argument("--sdk", default=None, help="mint, tinker or auto (default: ENGINE_SDK)")
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=PROBE_TIMEOUT_S,
        help=f"seconds one probe may take (default {PROBE_TIMEOUT_S:g})",
    )
    add_version_flag(parser)
    return parser


def format_table(url: str, findings: Sequence[Finding]) -> str:
    """Plain aligned text: capability, status, seconds, detail."""
    width = max(len(f.capability) for f in findings)
    lines = [f"Capabilities of {url}:"]
    for f in findings:
        seconds = f"{f.seconds:7.3f}s" if f.seconds is not None else " " * 8
        lines.append(f"  {f.capability:<{width}}  {f.status:<9}  {seconds}  {f.detail}")
    return "\n".join(lines)


def report(url: str, sdk: str, findings: Sequence[Finding]) -> dict[str, Any]:
    return {"url": url, "sdk": sdk, "findings": [f.to_json() for f in findings]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"URL must start with http:// or https://, got {args.url!r}")
    if not args.probe_timeout > 0:
        parser.error(f"--probe-timeout must be > 0, got {args.probe_timeout}")
    settings: dict[str, Any] = {"base_url": args.url, "local": False}
    if args.api_key:
        settings["api_key"] = args.api_key
    if args.base_model:
        settings["base_model"] = args.base_model
    if args.sdk:
        settings["sdk"] = args.sdk
    try:
        config = EngineConfig.from_env(os.environ, **settings)
        register_secret(config.session.api_key_value)
        from engine.session.opening import adapter_class

        sdk = choose_sdk(config.session.sdk)
        findings = anyio.run(
            lambda: probe_server(
                adapter_class(sdk),
                config,
                args.url,
                config.session.api_key_value,
                within=args.probe_timeout,
            )
        )
    except NoServerAnswers as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError) as exc:
        print(f"Error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report(args.url, sdk, findings), sort_keys=True))
    else:
        print(format_table(args.url, findings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
