"""Generate the docs' option tables from the code, so the docs cannot drift.

Why generated: ``python -m engine.run`` builds its flags from the settings models in
:mod:`engine.config` and ``python -m engine.local`` from its ``ServerConfig``
(:mod:`engine.local.config`); the docs show both as tables (``docs/settings.md``,
``docs/local-server.md``). This script renders those tables from the same sources and
either rewrites the sections between the ``<!-- BEGIN ... -->`` / ``<!-- END ... -->``
markers (``--write``) or fails when they differ (``--check``; tests/test_docs.py runs the
same comparison).

    python -m scripts.gen_config_table --write    # after changing a flag
    python -m scripts.gen_config_table --check    # exit 1 if a page is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from engine.common.setting import SettingField, setting_fields
from engine.config import GROUPS
from engine.config.sources import default_text, task_own_settings
from engine.local import config as local_config
from engine.local.__main__ import build_parser as build_local_parser
from engine.run import build_parser as build_run_parser

__all__ = ["GENERATED", "local_table", "main", "run_table", "update_sections"]

_ROOT = Path(__file__).resolve().parent.parent


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _options(parser: argparse.ArgumentParser) -> Iterable[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and not isinstance(
            action, argparse._HelpAction | argparse._VersionAction
        ):
            yield action


def _long_flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def run_table() -> str:
    """Markdown table of every ``python -m engine.run`` option, group by group (the
    TOML key names the group's table)."""
    rows = [
        "| flag | environment | TOML key | default | on resume | meaning |",
        "|---|---|---|---|---|---|",
    ]
    settings: list[tuple[SettingField, str | None, str]] = [
        (f, None, f.path) for name, m in GROUPS.items() for f in setting_fields(m, name)
    ]
    settings += [(f, t.spec, f"task.args.{f.name}") for t, f in task_own_settings()]
    for field, task, key in settings:
        env = ", ".join(_code(name) for name in field.env)
        default = _code(default_text(field, task))
        rows.append(
            f"| `{field.flag}` | {_cell(env)} | `{key}` | {_cell(default)} | "
            f"{field.marker.resume} | {_cell(field.description)} |"
        )
    flags = {field.flag for field, _, _ in settings}
    for action in _options(build_run_parser()):
        if _long_flag(action) not in flags:
            rows.append(f"| `{_long_flag(action)}` |  |  |  |  | {_cell(action.help or '')} |")
    return "\n".join(rows)


def local_table() -> str:
    """Markdown table of every ``python -m engine.local`` option: its settings, then the
    command's own flags."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    flags = set()
    for _, field in local_config.server_flags():
        flags.add(field.flag)
        env = ", ".join(_code(name) for name in field.marker.env)
        meaning = field.description.replace("see below", "see --help")
        if local_config.choices(field):
            meaning = f"{meaning}: {', '.join(local_config.choices(field))}"
        default = _code(local_config.default_text(field))
        rows.append(f"| `{field.flag}` | {env} | {_cell(default)} | {_cell(meaning)} |")
    for action in _options(build_local_parser()):
        if _long_flag(action) not in flags:
            meaning = action.help or ""
            if action.choices:
                meaning = f"{meaning}: {', '.join(map(str, action.choices))}"
            rows.append(f"| `{_long_flag(action)}` |  |  | {_cell(meaning)} |")
    return "\n".join(rows)


GENERATED: dict[Path, dict[str, Callable[[], str]]] = {
    _ROOT / "docs" / "settings.md": {"engine.run options": run_table},
    _ROOT / "docs" / "local-server.md": {"engine.local options": local_table},
}
"""Each page with generated sections: section name -> its renderer."""


def update_sections(text: str, sections: Mapping[str, Callable[[], str]]) -> str:
    """``text`` with each of ``sections`` replaced by its current rendering."""
    for name, render in sections.items():
        begin, end = f"<!-- BEGIN {name} (generated) -->", f"<!-- END {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"no '{begin}' ... '{end}' section")
        text = f"{text[: match.start()]}{begin}\n{render()}\n{end}{text[match.end() :]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.gen_config_table", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated sections")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for page, sections in GENERATED.items():
        current = page.read_text(encoding="utf-8")
        try:
            wanted = update_sections(current, sections)
        except ValueError as exc:
            print(f"error: {page.relative_to(_ROOT)}: {exc}", file=sys.stderr)
            return 2
        if wanted == current:
            continue
        if args.write:
            page.write_text(wanted, encoding="utf-8")
        else:
            stale.append(str(page.relative_to(_ROOT)))
    if stale:
        pages = ", ".join(stale)
        print(f"stale option tables in {pages}: run python -m scripts.gen_config_table --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
