"""Layout 2's attempt records (docs/upgrading.md#redis-layout): what a message costs Redis when it
is acked at its first attempt, the common case, is one plain command before the request
(`SET pw:{sub}:a:<id> 1 EX <settled_ttl> NX`) and, after it, the delivery log's XADD and a share of
one HSET and one LPUSH per script call: about two commands, where layout 1 takes five.

- `pw:{sub}:a:<id>` (a string): `1` after a first attempt, for `settled_ttl_seconds`; once counted
  again (a retry, a redelivered copy, a probe) `<n>,<probes>,<flags>,<last status>` for
  `attempts_ttl_seconds` (flags: `d`, an operator's discard); `s` once settled after a retry, for
  `settled_ttl_seconds`.
- `pw:{sub}:acked:<bucket>` (a hash per five minutes): the messages acked at their first attempt,
  each with its history (JSON) or `1`. A first-attempt record found in one of them is settled: a
  redelivered copy is acked without a request.

During the switch window (`read_layout_1`) the scripts also read a message's layout 1 record
(`attempts.py`), taking the higher count: no attempt number goes back across the switch.
"""

from __future__ import annotations

from worker.core.redis_batch import LUA_CALL, LUA_SETTLED_LIST, BatchScript

MAX_COUNT = 10**15  # as layout 1: below 2^53, every count under it is exact in Lua's doubles

# A record as stored: n, probes, flags, last status, and its form ('s' settled, 'f' first attempt,
# 'r' counted again, 'x' unreadable, nil none).
_PARSE = """
local function parse(v)
  if not v then return 0, 0, '', '', nil end
  if v == 's' then return 0, 0, '', '', 's' end
  local n, p, f, l = string.match(v, '^([^,]+),([^,]+),(%a*),(.*)$')
  local form = 'r'
  if not n then n, p, f, l, form = v, '0', '', '', 'f' end
  n, p = tonumber(n), tonumber(p)
  if not n or not p or n < 0 or p < 0 then return 0, 0, '', '', 'x' end
  return n, p, f, l, form
end
local function unparse(n, probes, flags, last)
  return string.format('%d,%d,%s,%s', n, probes, flags, last)
end
"""

# Shared KEYS: the buckets of acked messages still kept (newest first). Per operation KEYS: the
# record, the layout 1 record; ARGV: the message id. Shared ARGV: attempts TTL, settled TTL, whether
# to read layout 1 records, the number of buckets, what to do ('count', 'probe': a breaker's probe,
# counted as one; 'peek': read only). Returns per operation what layout 1's BEGIN returns: the count,
# the last status, the state (0 deliver, 1 discard, 2 settled, 3 a count no attempt can follow),
# whether the record was unreadable and started over, the probes among the attempts.
BEGIN = BatchScript(LUA_CALL + _PARSE + """
local ttl, settled_ttl, layout_1, nb, what = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4]), ARGV[5]
local out, j = {}, 6
for i = nb + 1, #KEYS, 2 do
  local key, id = KEYS[i], ARGV[j]
  j = j + 1
  local v = call('GET', key)
  local n, probes, flags, last, form = parse(v)
  if form == 'x' then corrupt[key] = true end
  local settled, raw = form == 's', v or ''
  if layout_1 and not settled then
    local h = redis.pcall('HMGET', KEYS[i + 1], 'discard', 'last', 'n', 'settled', 'probes')
    if type(h) == 'table' and not h.err then
      local old = tonumber(h[3]) or 0
      if h[4] then settled = true end
      if h[1] then flags = 'd' end
      if old > n then n, last, raw = old, h[2] or '', h[3] end
      probes = math.max(probes, tonumber(h[5]) or 0)
    end
  end
  if not settled and n == 1 and probes == 0 and flags == '' and last == '' then
    for b = 1, nb do
      if redis.pcall('HEXISTS', KEYS[b], id) == 1 then settled = true; break end
    end
  end
  local state = 0
  if settled then
    state = 2
  elseif flags == 'd' then
    state = 1
  elseif n >= MAX_COUNT or probes >= MAX_COUNT or n ~= n or probes ~= probes then
    state, last, n, probes = 3, 'n=' .. string.sub(raw, 1, 40), 0, 0
  elseif what ~= 'peek' then
    n = n + 1
    if what == 'probe' then probes = probes + 1 end
    if n == 1 and probes == 0 then
      redis.call('SET', key, '1', 'EX', settled_ttl)
    else
      redis.call('SET', key, unparse(n, probes, flags, last), 'EX', ttl)
    end
  end
  out[#out + 1] = n; out[#out + 1] = string.sub(last, 1, 64); out[#out + 1] = state
  out[#out + 1] = corrupt[key] and 1 or 0; out[#out + 1] = probes
end
return out
""".replace("MAX_COUNT", str(MAX_COUNT)), width=5)

# Shared KEYS: the settled list, the delivery log, this moment's bucket of acked messages. Shared
# ARGV: the settled list's TTL, the history cap, the settled TTL, the log's bound, whether the settled
# list's TTL is due a refresh, the bucket's TTL (0: set already), the attempts TTL. Per operation
# KEYS: the record, the history list; ARGV: message id, how it ended ('a' acked at its first attempt,
# 's' settled otherwise, 'f' failed and kept for a retry), the attempt's number, the last status, the
# settled summary, the history TTL (0: not kept), the number of history entries, the entries, the
# number of log entries, and each entry (a JSON document: the stream's one field `e`).
RECORD = BatchScript(LUA_CALL + _PARSE + """
local list_ttl, cap, settled_ttl, log_max = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local refresh, bucket_ttl, ttl = ARGV[5], tonumber(ARGV[6]), ARGV[7]
local a, summaries, acked, out = 8, {}, {}, {}
for k = 4, #KEYS, 2 do
  local id, how, number, last, summary = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[a + 4]
  local history_ttl, count = ARGV[a + 5], tonumber(ARGV[a + 6])
  a = a + 7
  local kept = count > 0 and history_ttl ~= '0'
  if how == 'a' then
    acked[#acked + 1] = id
    acked[#acked + 1] = kept and ('[' .. table.concat(ARGV, ',', a, a + count - 1) .. ']') or '1'
  elseif kept then
    if call('RPUSH', KEYS[k + 1], unpack(ARGV, a, a + count - 1)) > cap then
      redis.call('LTRIM', KEYS[k + 1], -cap, -1)
    end
    redis.call('EXPIRE', KEYS[k + 1], history_ttl)
  end
  a = a + count
  local logged = tonumber(ARGV[a])
  a = a + 1
  for e = 1, logged do
    call('XADD', KEYS[2], 'MAXLEN', '~', log_max, '*', 'e', ARGV[a + e - 1])
  end
  a = a + logged
  if how == 'f' then
    local n, probes, flags = parse(call('GET', KEYS[k]))
    redis.call('SET', KEYS[k], unparse(math.max(n, number), probes, flags, last), 'EX', ttl)
  else
    if how == 's' then call('SET', KEYS[k], 's', 'EX', settled_ttl) end
    summaries[#summaries + 1] = summary
  end
  out[#out + 1] = 1
end
if #acked > 0 then
  call('HSET', KEYS[3], unpack(acked))
  if bucket_ttl > 0 then redis.call('EXPIRE', KEYS[3], bucket_ttl) end
end
""" + LUA_SETTLED_LIST + """
return out
""", width=1)

# Attempts counted that no request carried (`AttemptStore.unsent`): counted as probes are. Per
# operation KEYS: the record; shared ARGV: the attempts TTL.
UNSENT = BatchScript(LUA_CALL + _PARSE + """
local out = {}
for i = 1, #KEYS do
  local n, probes, flags, last, form = parse(call('GET', KEYS[i]))
  if form ~= 's' then
    redis.call('SET', KEYS[i], unparse(n, probes + 1, flags, last), 'EX', ARGV[1])
  end
  out[#out + 1] = 1
end
return out
""", width=1)

# An operator's discard mark (`attempts.mark_discard`): 1 marked, 0 settled already, -1 unknown.
# KEYS: the record, then the buckets of acked messages; ARGV: the message id, the mark's TTL.
MARK_DISCARD = _PARSE + """
local n, probes, flags, last, form = parse(redis.call('GET', KEYS[1]))
if form == nil then return -1 end
if form == 's' then return 0 end
if form == 'f' then
  for b = 2, #KEYS do
    if redis.call('HEXISTS', KEYS[b], ARGV[1]) == 1 then return 0 end
  end
end
redis.call('SET', KEYS[1], unparse(n, probes, 'd', last), 'EX', ARGV[2])
return 1
"""

