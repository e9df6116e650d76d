"""GSM8K to the JSONL file the ``gsm8k_ppo`` and ``gsm8k_grpo`` recipes read (``data.prompts``).

Each record keeps GSM8K's two columns: ``question``, with Qwen's math instruction appended (the
prompt, ``data.field=question``), and ``answer``, the worked solution ending in ``#### 42`` that
``oppo.rewards.math_accuracy`` reads the gold number from. Where there is network::

    python examples/gsm8k_export.py                      # openai/gsm8k (main, train) -> gsm8k_train.jsonl

On a machine without network, download the data set's file where there is one and give its path::

    hf download openai/gsm8k --repo-type dataset --local-dir gsm8k     # (where there is network)
    python examples/gsm8k_export.py gsm8k/main/train-00000-of-00001.parquet --out gsm8k_train.jsonl

A local ``.jsonl``/``.json`` file (one GSM8K record a line, or a JSON list of them) needs nothing
installed; a ``.parquet`` file needs ``pyarrow``; a hub name needs ``datasets`` (``pip install datasets``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Qwen2.5-Math's instruction, as the recipes' policy (Qwen2.5-0.5B-Instruct) was trained to follow it
INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."


def read_records(source: str, config: str = "main", split: str = "train") -> list[dict]:
    """GSM8K's records (dicts with ``question`` and ``answer``) from a local JSONL/JSON or parquet
    file, or from the hub by name with ``datasets``."""
    path = Path(source)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if path.suffix == ".parquet" and path.is_file():
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{source}: reading a parquet file needs pyarrow (pip install pyarrow), or give a "
                             f"JSONL file") from None
        return pq.read_table(path).to_pylist()
    if path.exists():
        raise SystemExit(f"{source}: not a .jsonl, .json or .parquet file of GSM8K records")
    try:
        import datasets
    except ImportError:
        raise SystemExit(f"{source!r} is not a local file, so it is a hub data set, and reading one needs the "
                         f"'datasets' package (pip install datasets); without it, give a local .jsonl or "
                         f".parquet file (hf download openai/gsm8k --repo-type dataset --local-dir gsm8k)") from None
    try:
        return list(datasets.load_dataset(source, config, split=split))
    except Exception as e:  # no network: requests' or httpx's ConnectionError, hub timeouts, offline mode, ...
        if not _offline(e):
            raise
        raise SystemExit(f"Could not reach the Hugging Face hub for {source!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no network'}). Without network, download the "
                         f"data set where there is one (hf download openai/gsm8k --repo-type dataset --local-dir "
                         f"gsm8k) and give its file: python examples/gsm8k_export.py "
                         f"gsm8k/main/train-00000-of-00001.parquet --out gsm8k_train.jsonl") from None


def _offline(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) says the hub could not be reached: a
    ``ConnectionError`` of the standard library, requests or httpx, a timeout, or the hub's offline mode."""
    while e is not None:
        names = [c.__name__ for c in type(e).__mro__]
        if isinstance(e, (ConnectionError, TimeoutError)) or any(
                n.endswith(("ConnectionError", "ConnectError", "Timeout", "TimeoutException", "OfflineModeIsEnabled"))
                for n in names):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def export(records: list[dict], out: Path) -> int:
    """Write the recipes' JSONL (question + instruction, answer); returns the record count."""
    with out.open("w", encoding="utf-8") as f:
        for i, r in enumerate(records):
            if not isinstance(r, dict) or not {"question", "answer"} <= set(r):
                raise SystemExit(f"record {i}: GSM8K records have 'question' and 'answer' columns; this one has "
                                 f"{sorted(r) if isinstance(r, dict) else type(r).__name__}")
            f.write(json.dumps({"question": r["question"] + INSTRUCTION, "answer": r["answer"]}) + "\n")
    return len(records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", default="openai/gsm8k",
                   help="A hub data set name (needs datasets), or a local .jsonl, .json or .parquet file.")
    p.add_argument("--config", default="main", help="The hub data set's configuration (default: main).")
    p.add_argument("--split", default="train", help="The hub data set's split (default: train).")
    p.add_argument("--out", default="gsm8k_train.jsonl", help="The JSONL file to write (the recipes' data.prompts).")
    a = p.parse_args(argv)
    n = export(read_records(a.source, a.config, a.split), Path(a.out))
    print(f"wrote {n} GSM8K prompts to {a.out} (the recipes' data.prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
