"""The Lua scripts the Redis store runs, one per operation, each touching one hash tag.

Why scripts rather than plain commands: the pure-Python RESP codec costs about a microsecond
per array element each way, so a ``ZMSCORE`` of 2,048 members for four replicas spends several
milliseconds packing members and parsing 8,192 scores in the proxy. The scripts instead take a
prompt's whole chain as **one** argument (8 bytes per hash, big-endian, ``pack_chain``) and
answer with one integer, so the proxy's cost no longer grows with the prompt. Every script
touches keys of a single hash tag, so they run unchanged on Redis Cluster.

Members of an index sorted set are those same 8-byte strings (less memory and shorter commands
than 20-digit decimals). Scores are milliseconds since 2020-01-01 by the Redis server's clock
(one clock for every proxy), minus 1 µs per block position so that a chain's head is more
recent than its tail. ``ZADD GT`` keeps the highest score a member ever had, so a block always
outranks the blocks after it and trimming by rank takes tails first: the index stays
prefix-closed, which is what lets the lookup binary-search.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

SCORE_EPOCH_S = 1_577_836_800  # 2020-01-01T00:00:00Z


def pack_chain(hashes: Sequence[int]) -> bytes:
    """A chain of 64-bit hashes as one string, 8 bytes per hash, big-endian."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's source and the SHA1 that ``EVALSHA`` names it by."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


LOOKUP = LuaScript(
    "lookup",
    """
-- KEYS[1] a replica's index; ARGV[1] the chain (8 bytes a hash).
-- Returns how many leading hashes the index holds (binary search: the index is prefix-closed).
local chain = ARGV[1]
local lo, hi = 0, #chain / 8
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  if redis.call('ZSCORE', KEYS[1], string.sub(chain, mid * 8 - 7, mid * 8)) then
    lo = mid
  else
    hi = mid - 1
  end
end
return lo
""",
)

RECORD = LuaScript(
    "record",
    f"""
-- KEYS[1] a replica's index; ARGV[1] the chain, ARGV[2] capacity in blocks, ARGV[3] idle TTL ms.
local t = redis.call('TIME')
local now = (tonumber(t[1]) - {SCORE_EPOCH_S}) * 1000 + tonumber(t[2]) / 1000
local chain = ARGV[1]
local n = #chain / 8
local i = 1
while i <= n do
  local j = math.min(n, i + 999)
  local args = {{}}
  for k = i, j do
    args[#args + 1] = string.format('%.4f', now - (k - 1) * 0.001)
    args[#args + 1] = string.sub(chain, k * 8 - 7, k * 8)
  end
  redis.call('ZADD', KEYS[1], 'GT', unpack(args))
  i = j + 1
end
local cap = tonumber(ARGV[2])
local card = redis.call('ZCARD', KEYS[1])
if card > cap then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, card - cap - 1)
end
if card > 0 and cap > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return card
""",
)

ADD_STATS = LuaScript(
    "add_stats",
    """
-- KEYS: [1] minute bucket, [2] hour bucket, [3] the hour's anchor ranking, [4] its anchor counters.
-- ARGV: [1] minute expire-at, [2] hour expire-at, [3] n, then n field/value pairs for both
-- buckets; then anchor ('' for none), last-seen ts, label, cap, trim threshold and the
-- anchor's field/value pairs.
local n = tonumber(ARGV[3])
for i = 4, 3 + 2 * n, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIREAT', KEYS[1], ARGV[1])
redis.call('EXPIREAT', KEYS[2], ARGV[2])
local a = 4 + 2 * n
local anchor = ARGV[a]
if anchor == '' then
  return 0
end
local ts, label = ARGV[a + 1], ARGV[a + 2]
local cap, threshold = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
local score = '0'
for i = a + 5, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[4], anchor .. '|' .. ARGV[i], ARGV[i + 1])
  if ARGV[i] == 'p' then
    score = ARGV[i + 1]
  end
end
redis.call('ZINCRBY', KEYS[3], score, anchor)
local seen = redis.call('HGET', KEYS[4], anchor .. '|t')
if not seen or tonumber(seen) < tonumber(ts) then
  redis.call('HSET', KEYS[4], anchor .. '|t', ts)
end
if label ~= '' then
  redis.call('HSET', KEYS[4], anchor .. '|l', label)
end
local card = redis.call('ZCARD', KEYS[3])
if card > threshold then
  local gone = redis.call('ZPOPMIN', KEYS[3], card - cap)
  for i = 1, #gone, 2 do
    local g = gone[i]
    redis.call('HDEL', KEYS[4], g .. '|r', g .. '|p', g .. '|c', g .. '|cp', g .. '|t', g .. '|l')
  end
end
redis.call('EXPIREAT', KEYS[3], ARGV[2])
redis.call('EXPIREAT', KEYS[4], ARGV[2])
return 1
""",
)

TRAFFIC_READ = LuaScript(
    "traffic_read",
    """
-- KEYS: [1] the current traffic bucket, [2] the previous one; ARGV[1] the request's leading
-- chain (8 bytes a hash). Returns "window requests,count per hash,..." (both buckets summed) as
-- one string: parsing one string costs the proxy far less than an array of 65 integers.
local chain = ARGV[1]
local fields = {'n'}
for i = 1, #chain / 8 do
  fields[#fields + 1] = string.sub(chain, i * 8 - 7, i * 8)
end
local cur = redis.call('HMGET', KEYS[1], unpack(fields))
local prev = redis.call('HMGET', KEYS[2], unpack(fields))
local counts = {}
for i = 1, #fields do
  counts[i] = (tonumber(cur[i]) or 0) + (tonumber(prev[i]) or 0)
end
return table.concat(counts, ',')
""",
)

LOADS_READ = LuaScript(
    "loads_read",
    f"""
-- KEYS: [1] in-flight counts "<proxy>|<replica id>" -> count, [2] proxies by last write (ms).
-- ARGV: [1] in-flight TTL ms, then the replica ids. Returns the load per replica, the sum over
-- the proxies that wrote within the TTL, as one comma-separated string ('' for no replica).
local nr = #ARGV - 1
local loads = {{}}
for j = 1, nr do
  loads[j] = 0
end
if nr == 0 then
  return ''
end
local t = redis.call('TIME')
local now = (tonumber(t[1]) - {SCORE_EPOCH_S}) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[2], now - tonumber(ARGV[1]), '+inf')
if #live == 0 then
  return table.concat(loads, ',')
end
local names = {{}}
for _, proxy in ipairs(live) do
  for j = 1, nr do
    names[#names + 1] = proxy .. '|' .. ARGV[j + 1]
  end
end
local values = redis.call('HMGET', KEYS[1], unpack(names))
for k = 1, #names do
  local v = tonumber(values[k])
  if v and v > 0 then
    local j = (k - 1) % nr + 1
    loads[j] = loads[j] + v
  end
end
return table.concat(loads, ',')
""",
)

OBSERVE = LuaScript(
    "observe",
    """
-- KEYS[1] the current traffic bucket; ARGV[1] the leading chain, ARGV[2] expire-at (s),
-- ARGV[3] the most hashes a bucket counts. Counts one request ('n') and each hash it carries;
-- a full bucket counts only the hashes it holds (the leading run it knows: TRAFFIC_MAX_HASHES).
local chain = ARGV[1]
local n = #chain / 8
redis.call('HINCRBY', KEYS[1], 'n', 1)
if redis.call('HLEN', KEYS[1]) - 1 + n <= tonumber(ARGV[3]) then
  for i = 1, n do
    redis.call('HINCRBY', KEYS[1], string.sub(chain, i * 8 - 7, i * 8), 1)
  end
else
  for i = 1, n do
    local field = string.sub(chain, i * 8 - 7, i * 8)
    if redis.call('HEXISTS', KEYS[1], field) == 0 then
      break
    end
    redis.call('HINCRBY', KEYS[1], field, 1)
  end
end
redis.call('EXPIREAT', KEYS[1], ARGV[2])
return 1
""",
)

IN_FLIGHT = LuaScript(
    "in_flight",
    f"""
-- KEYS: [1] in-flight counts "<proxy>|<replica id>" -> count, [2] proxies by last write (ms).
-- ARGV: [1] proxy id, [2] replica id, [3] the proxy's count now (absolute), [4] TTL ms.
-- Absolute counts heal a lost write at the next one; proxies silent for the TTL (crashed) are
-- dropped here and ignored by LOADS_READ.
local t = redis.call('TIME')
local now = (tonumber(t[1]) - {SCORE_EPOCH_S}) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
local field = ARGV[1] .. '|' .. ARGV[2]
if tonumber(ARGV[3]) > 0 then
  redis.call('HSET', KEYS[1], field, ARGV[3])
else
  redis.call('HDEL', KEYS[1], field)
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - ttl))
if #stale > 0 then
  local gone = {{}}
  for _, proxy in ipairs(stale) do
    gone[proxy] = true
  end
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    local proxy = string.match(name, '^([^|]*)|')
    if proxy and gone[proxy] then
      redis.call('HDEL', KEYS[1], name)
    end
  end
  redis.call('ZREM', KEYS[2], unpack(stale))
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return 1
""",
)

ALL_SCRIPTS = (LOOKUP, RECORD, ADD_STATS, TRAFFIC_READ, LOADS_READ, OBSERVE, IN_FLIGHT)
