"""Lua scripts: every check-then-write of the backend runs inside Redis as one script, so it
is atomic without WATCH/MULTI retry loops.

Rules the scripts follow:

* All checks come before the first write: Redis does not roll back a script that fails half
  way, so a script may only fail before it has changed anything.
* Every key a script touches is passed in KEYS (all share the pipeline's hash tag).
* Integers travel as decimal strings and are formatted with ``%d``: Lua numbers are doubles
  and ``tostring`` would print large ones in exponent form.
* Counters that must only grow (event offsets, epochs, fencing tokens) start, when missing,
  at the server clock in microseconds. A Redis restart without persistence loses them; a
  restarted counter then still starts above every value issued before (unless the server
  clock went backwards or more than one value per microsecond was issued on average), so
  Iceberg snapshot summaries and table properties written earlier keep fencing and
  de-duplicating correctly.
"""

from __future__ import annotations

_HELPERS = r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function fmt(n)
  return string.format('%d', n)
end

-- the sequence part of a stream's last generated id (0 when there is no stream)
local function stream_last_seq(key)
  if redis.call('EXISTS', key) == 0 then return 0 end
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      local ms, seq = string.match(info[i + 1], '^(%d+)-(%d+)$')
      if ms ~= '0' then return nil end
      return tonumber(seq)
    end
  end
  return 0
end

local function stream_last_id(key)
  if redis.call('EXISTS', key) == 0 then return '0-0' end
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return '0-0'
end

-- create a missing growing counter at the clock (and at least at `floor`)
local function counter_init(key, floor)
  if redis.call('EXISTS', key) == 1 then return end
  local v = now_us()
  if floor ~= nil and floor > v then v = floor end
  redis.call('SET', key, fmt(v))
end

-- the lease is ours, or free and no newer token was issued since ours
local function is_leader(lease_key, token_key, holder, token)
  local cur = redis.call('GET', lease_key)
  if cur and cur ~= token .. '\n' .. holder then return false end
  return redis.call('GET', token_key) == token
end
"""

# KEYS: epochs, broadcasts  ARGV: writer_id
# -> {epoch, last broadcast id}
OPEN_WRITER = (
    _HELPERS
    + r"""
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  redis.call('HSET', KEYS[1], ARGV[1], fmt(now_us()))
end
local epoch = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return {fmt(epoch), stream_last_id(KEYS[2])}
"""
)

# KEYS: epochs, event_seq, events, batches, batch_floors, sources(writer)
# ARGV: writer_id, epoch, batch_seq ('' for a single event without batch key), n_events,
#       event_1 .. event_n, then (field, value) pairs of source positions
# -> {'ok', first offset, last offset} | {'dup'} | {'fenced', current epoch} | {'lost'}
#    | {'foreign'} (the stream holds ids this backend did not write)
PUBLISH = (
    _HELPERS
    + r"""
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return {'lost'} end
if current ~= ARGV[2] then return {'fenced', current} end
local member = nil
if ARGV[3] ~= '' then
  member = ARGV[1] .. '\n' .. ARGV[3]
  if redis.call('ZSCORE', KEYS[4], member) then return {'dup'} end
  local floor = redis.call('HGET', KEYS[5], ARGV[1])
  if floor and tonumber(ARGV[3]) <= tonumber(floor) then return {'dup'} end
end
local n = tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 0 then
  local last_seq = stream_last_seq(KEYS[3])
  if last_seq == nil then return {'foreign'} end
  counter_init(KEYS[2], last_seq)
end
local last = redis.call('INCRBY', KEYS[2], n)
local first = last - n + 1
for i = 1, n do
  redis.call('XADD', KEYS[3], '0-' .. fmt(first + i - 1), 'e', ARGV[4 + i])
end
if member then redis.call('ZADD', KEYS[4], fmt(last), member) end
for j = 5 + n, #ARGV, 2 do
  redis.call('HSET', KEYS[6], ARGV[j], ARGV[j + 1])
end
return {'ok', fmt(first), fmt(last)}
"""
)

# KEYS: lease, token  ARGV: holder, ttl_ms
# -> {'ok', token} (new lease) | {'held', token} (already ours, extended) | {'busy', holder, pttl}
ACQUIRE = (
    _HELPERS
    + r"""
local cur = redis.call('GET', KEYS[1])
if cur then
  local token, holder = string.match(cur, '^(%d+)\n(.*)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {'held', token}
  end
  return {'busy', holder or cur, redis.call('PTTL', KEYS[1])}
end
counter_init(KEYS[2], nil)
local token = fmt(redis.call('INCR', KEYS[2]))
redis.call('SET', KEYS[1], token .. '\n' .. ARGV[1], 'PX', ARGV[2])
return {'ok', token}
"""
)

# KEYS: lease, token  ARGV: holder, token, ttl_ms  -> {'ok'} | {'lost', current holder line}
RENEW = (
    _HELPERS
    + r"""
if not is_leader(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then
  return {'lost', redis.call('GET', KEYS[1]) or ''}
end
redis.call('SET', KEYS[1], ARGV[2] .. '\n' .. ARGV[1], 'PX', ARGV[3])
return {'ok'}
"""
)

# KEYS: lease  ARGV: holder, token  -> 1 when released, 0 when not ours
RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[2] .. '\n' .. ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease, token, position  ARGV: holder, token, position JSON  -> {'ok'} | {'stale'}
STORE_POSITION = (
    _HELPERS
    + r"""
if not is_leader(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then return {'stale'} end
redis.call('SET', KEYS[3], ARGV[3])
return {'ok'}
"""
)

# KEYS: lease, token, broadcasts  ARGV: holder, token, max_len, event...
# -> {'ok', last stream id} | {'stale'}
BROADCAST = (
    _HELPERS
    + r"""
if not is_leader(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then return {'stale'} end
local id
for i = 4, #ARGV do
  id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[i])
end
return {'ok', id}
"""
)

# KEYS: events, batches, batch_floors  ARGV: trim below this offset
# -> number of events trimmed
PRUNE = r"""
local upto = ARGV[1]
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto)
for _, m in ipairs(gone) do
  local w, s = string.match(m, '^(.*)\n(%-?%d+)$')
  if w then
    local floor = redis.call('HGET', KEYS[3], w)
    if (not floor) or tonumber(s) > tonumber(floor) then
      redis.call('HSET', KEYS[3], w, s)
    end
  end
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. upto) end
return redis.call('XTRIM', KEYS[1], 'MINID', '0-' .. upto)
"""
