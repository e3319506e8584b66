#!/usr/bin/env bash
# prefixgate from the shell: health, models, a chat completion, a streamed one, the proxy's headers.
#
#   bash examples/curl.sh [BASE_URL]        (default: $OPENAI_BASE_URL, else http://localhost:8000/v1)
#
# Needs curl. MODEL (default smollm2), OPENAI_API_KEY (default "unused") and PREFIXGATE_ADMIN_URL
# (the proxy's admin port, default http://localhost:8001) are read from the environment.
set -euo pipefail

BASE_URL="${1:-${OPENAI_BASE_URL:-http://localhost:8000/v1}}"
BASE_URL="${BASE_URL%/}"
ADMIN_URL="${PREFIXGATE_ADMIN_URL:-http://localhost:8001}"   # the proxy's own routes
ADMIN_URL="${ADMIN_URL%/}"
MODEL="${MODEL:-smollm2}"
AUTH="Authorization: Bearer ${OPENAI_API_KEY:-unused}"

echo "== liveness and readiness"
curl -fsS "$ADMIN_URL/healthz"; echo
curl -sS "$ADMIN_URL/readyz"; echo   # 503 with a per-backend map when no backend is healthy

echo "== models (passed through to the backend)"
curl -fsS -H "$AUTH" "$BASE_URL/models"; echo

# The system prompt carries a timestamp: the canonicalizer moves it next to the user message so
# the prompt's start stays byte-identical between requests (see X-Prefixgate-Canonical below).
chat_body() {  # $1: extra top-level fields, e.g. ', "stream": true'
  cat <<JSON
{
  "model": "$MODEL",
  "max_tokens": 24,
  "messages": [
    {"role": "system", "content": "You are a terse assistant. Current time: $(date -u +%Y-%m-%dT%H:%M:%SZ)"},
    {"role": "user", "content": "Name one prime number."}
  ]${1:-}
}
JSON
}

echo "== chat completion (response headers, then body)"
curl -fsS -D - -H "$AUTH" -H "Content-Type: application/json" \
  -H "X-Request-Id: curl-example-1" \
  "$BASE_URL/chat/completions" -d "$(chat_body)" \
  | grep -i -E '^(x-request-id|x-prefixgate-canonical):|^\{' ; echo

echo "== streamed chat completion (server-sent events, unbuffered)"
curl -fsS -N -H "$AUTH" -H "Content-Type: application/json" \
  "$BASE_URL/chat/completions" \
  -d "$(chat_body ', "stream": true, "stream_options": {"include_usage": true}')"
