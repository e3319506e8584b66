"""Stream a chat completion through prefixgate with the official OpenAI Python SDK.

Start the proxy first (`make run`), then: `.venv/bin/python examples/openai_sdk.py`.
The second request shares the first one's system prompt, so the backend serves it from cache:
compare the two `cached_tokens` figures printed (and the records in logs/requests.jsonl).
"""

from __future__ import annotations

import os

from openai import OpenAI

SYSTEM = "You are a concise assistant for a hiking-gear shop. " * 30


def main() -> None:
    client = OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
    )
    for question in ("Which boots for wet trails?", "Which socks go with them?"):
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                cached = details.cached_tokens if details else None
                print(f"\n[prompt_tokens={chunk.usage.prompt_tokens} cached_tokens={cached}]\n")


if __name__ == "__main__":
    main()
