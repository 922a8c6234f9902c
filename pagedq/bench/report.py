"""Presenting benchmark results: a plain-text table for people, a JSON record for machines
(with enough context — device, versions, model shape, command — to compare runs later)."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch

REFERENCE_PEER = "pagedq"


def ratio_column(rows: list[dict], key: str) -> dict[str, float] | None:
    """pagedq's `key` divided by each peer's, or None when pagedq did not run."""
    reference = next((row for row in rows if row["peer"] == REFERENCE_PEER), None)
    if reference is None:
        return None
    return {row["peer"]: reference[key] / row[key] if row[key] else float("inf") for row in rows}


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages: timings on a shared CPU mean little without them."""
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def throughput_table(rows: list[dict]) -> str:
    """One line per peer from PeerRun.summary() dicts: output tok/s over the rounds
    (min / median / max; seconds are the median round's), and pagedq / peer of medians."""
    ratios = ratio_column(rows, "output_tokens_per_s")
    header = ["peer", "requests", "output tokens", "rounds", "seconds", "tok/s min", "median", "max"]
    if ratios is not None:
        header.append(f"{REFERENCE_PEER} / peer")
    lines = []
    for row in rows:
        line = [
            row["peer"],
            str(row["requests"]),
            str(row["output_tokens"]),
            str(len(row["round_seconds"])),
            f"{row['seconds']:.2f}",
            f"{row['output_tokens_per_s_min']:.1f}",
            f"{row['output_tokens_per_s']:.1f}",
            f"{row['output_tokens_per_s_max']:.1f}",
        ]
        if ratios is not None:
            line.append(f"{ratios[row['peer']]:.2f}x")
        lines.append(line)
    return format_table(header, lines)


def device_description(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count()}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("pagedq", "torch", "transformers", "triton"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def model_description(model_dir: str, hf_config) -> dict:
    return {"path": str(Path(model_dir).resolve()), "config": hf_config.to_dict()}


def options(args) -> dict:
    """The parsed command-line options (the process's argv may belong to a test runner)."""
    return {key: str(value) if not isinstance(value, (int, float, bool, type(None))) else value
            for key, value in vars(args).items() if key != "handler"}


def write_json(path: str, args, record: dict) -> None:
    record = {"command": {"argv": sys.argv, "options": options(args)}, **record}
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
