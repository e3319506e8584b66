"""Concurrent streaming chat completions through prefixgate with the async OpenAI client.

    .venv/bin/python examples/openai_sdk_async.py [--base-url URL] [--concurrency 4]

One request first, to put the shared system prompt in the backend's cache, then several at once
that share it. Each prints its time to first token as the client saw it and the prompt tokens the
backend served from cache. The base URL comes from --base-url, else OPENAI_BASE_URL, else
http://localhost:8000/v1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from openai import AsyncOpenAI

SYSTEM = (
    "You are the support assistant of a bicycle repair shop. Answer in two sentences, "
    "name the part involved, and suggest whether the customer can fix it at home. " * 12
)
QUESTIONS = (
    "My chain skips under load.",
    "The rear brake squeals.",
    "The front wheel wobbles.",
    "Gears will not shift to the largest cog.",
    "The saddle keeps sliding down.",
    "Pedals click on every turn.",
)


async def ask(client: AsyncOpenAI, model: str, question: str, max_tokens: int) -> str:
    """Stream one answer; return a one-line summary of its timing and cache use."""
    t0 = time.perf_counter()
    ttft: float | None = None
    prompt = cached = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with stream:
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                prompt = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = details.cached_tokens if details else None
    shown = f"{ttft * 1000:7.1f} ms" if ttft is not None else "      -   "
    return f"ttft {shown}  prompt_tokens={prompt} cached_tokens={cached}  {question}"


async def run(args: argparse.Namespace) -> None:
    async with AsyncOpenAI(
        base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused")
    ) as client:
        print("warm-up:", await ask(client, args.model, QUESTIONS[0], args.max_tokens))
        questions = [QUESTIONS[1 + i % (len(QUESTIONS) - 1)] for i in range(args.concurrency)]
        results = await asyncio.gather(
            *(ask(client, args.model, q, args.max_tokens) for q in questions)
        )
        for line in results:
            print("parallel:", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1")
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
