"""The benchmark record: run metadata, and a result written as JSON plus a Markdown table."""

from __future__ import annotations

import datetime
import json
import pathlib

import jax


def meta(**extra):
    """Date, GPU, device count and versions of this run (plus `extra`)."""
    try:
        import cutlass
        dsl = getattr(cutlass, "__version__", "?")
    except ImportError:
        dsl = None
    return dict(date=datetime.date.today().isoformat(), gpu=jax.devices()[0].device_kind,
                gpus=len(jax.devices()), jax=jax.__version__, cutlass_dsl=dsl, **extra)


def write(out, name, info, rows, title, columns):
    """Write `name`.json (meta + rows) and `name`.md (a table) under `out`; print the table.

    `columns`: (header, format) pairs; format is a str.format pattern over a row's keys.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta=info, rows=rows), indent=1))
    lines = [f"{title}: {info['gpus']}x {info['gpu']}, {info['date']}, jax {info['jax']}, "
             f"CuTe DSL {info['cutlass_dsl']}", "",
             "| " + " | ".join(h for h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f.format(**row) for _, f in columns) + " |")
    text = "\n".join(lines)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    return text
