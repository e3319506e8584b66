"""Stream chat completions through prefixgate with the official OpenAI Python SDK (sync client).

Start the proxy first (`make run`), then:

    .venv/bin/python examples/openai_sdk.py [--base-url http://localhost:8000/v1]

The second request shares the first one's system prompt, so the backend serves it from cache:
compare the two `cached_tokens` figures printed (and the records in logs/requests.jsonl).
The base URL comes from --base-url, else OPENAI_BASE_URL, else http://localhost:8000/v1.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

SYSTEM = "You are a concise assistant for a hiking-gear shop. " * 30
QUESTIONS = ("Which boots for wet trails?", "Which socks go with them?")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1")
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=32)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with OpenAI(
        base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused")
    ) as client:
        for question in QUESTIONS:
            stream = client.chat.completions.create(
                model=args.model,
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                max_tokens=args.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
            with stream:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        print(chunk.choices[0].delta.content, end="", flush=True)
                    if chunk.usage is not None:
                        details = chunk.usage.prompt_tokens_details
                        cached = details.cached_tokens if details else None
                        print(
                            f"\n[prompt_tokens={chunk.usage.prompt_tokens} "
                            f"cached_tokens={cached}]\n"
                        )


if __name__ == "__main__":
    main()
