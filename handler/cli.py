"""Stream one chat completion from the engine to the terminal: the quickstart's main job.

    python -m handler.cli "Write a haiku about GPUs." [--model PATH_OR_REPO] [--max-tokens N]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from engine import AsyncEngine, EngineError, SamplingParams
from handler.settings import SettingsError, load_settings


async def _chat(eng: AsyncEngine, prompt: str, params: SamplingParams) -> int:
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    t0 = time.perf_counter()
    ttft, n = None, 0
    async for out in eng.generate(text, params):
        delta = out.outputs[0]
        if ttft is None:
            ttft = time.perf_counter() - t0
        n += len(delta.delta_token_ids)
        sys.stdout.write(delta.delta_text)
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    print(f"\n\n[{n} tokens, TTFT {ttft * 1000:.0f} ms, {n / dt:.1f} tok/s, finish={delta.finish_reason}]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--model", default=None,
                    help="local dir or HF repo id in the HF cache; default: $MODEL_NAME, else the embedded SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_settings().engine_config()
        if args.model:
            cfg = cfg.replace(model=args.model)
        eng = AsyncEngine(cfg)
        return asyncio.run(_chat(eng, args.prompt,
                                 SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)))
    except (EngineError, SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
