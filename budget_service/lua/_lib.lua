-- _lib.lua: prepended to every per-category script (budget_service/scripts.py).
-- KEYS are the category's keys in `CategoryKeys` order (budget_service/keys.py); K names them
-- (tests/unit/budget_service/test_scripts.py checks the two orders agree). Nothing here builds a key name.
local K = {
  state = KEYS[1], pending = KEYS[2], leases = KEYS[3], parked = KEYS[4],
  reserved = KEYS[5], final = KEYS[6], hist = KEYS[7], results = KEYS[8], dead = KEYS[9],
  prompts = KEYS[10], reasons = KEYS[11], worst = KEYS[12], var = KEYS[13], seq = KEYS[14],
  written = KEYS[15], follow = KEYS[16], history = KEYS[17], cut = KEYS[18],
  events = KEYS[19], retried = KEYS[20], cache = KEYS[21], engine_of = KEYS[22],
  extra = KEYS[23], modes = KEYS[24], near = KEYS[25],
}
-- entries kept in a category's event log (`events`, a stream)
local EVENTS_MAXLEN = 1000
-- the cap of an uncapped category (`cap_tokens = "none"`)
local UNCAPPED = 'none'

-- cap_of(raw): a state's cap as a number: math.huge when uncapped, nil when absent.
local function cap_of(raw)
  if raw == UNCAPPED then return math.huge end
  return tonumber(raw or '')
end

-- drop_inflight(s): remove sample s from the per-sample hashes `reserved` (its estimate),
-- `worst` (the most it can add) and `var` (the variance of what it will add), and subtract
-- each from the state total of the same name.
local function drop_inflight(s)
  for field, key in pairs({reserved = K.reserved, worst = K.worst, var = K.var}) do
    local raw = redis.call('HGET', key, s)
    if raw then
      redis.call('HDEL', key, s)
      local v = tonumber(raw)
      -- never `-0`: HINCRBY refuses it as "not an integer"
      if v ~= 0 then redis.call('HINCRBY', K.state, field, -v) end
    end
  end
end

-- forget(s): sample s is final: drop everything the ledger kept for it while it was open.
local function forget(s)
  drop_inflight(s)
  redis.call('HDEL', K.pending, s)
  redis.call('ZREM', K.leases, s)
  redis.call('ZREM', K.parked, s)
  redis.call('HDEL', K.seq, s)
  redis.call('HDEL', K.engine_of, s)
  redis.call('HDEL', K.extra, s)
end

-- unseen(s): s is neither final nor pending: a sample (or a conversation's turn) the ledger
-- has not fed yet, or has forgotten.
local function unseen(s)
  return redis.call('HEXISTS', K.final, s) == 0 and redis.call('HEXISTS', K.pending, s) == 0
end

-- pend(s, json, deadline): feed s: pending with its payload (Pending JSON) and leased until
-- deadline (ms), when the reaper enqueues it again unless a worker took it (feed.lua,
-- feed_follow.lua).
local function pend(s, json, deadline)
  redis.call('HSET', K.pending, s, json)
  redis.call('ZADD', K.leases, deadline, s)
end

-- hold(s, now): the category is closed: s is not sent, and not final either. It waits parked
-- (its payload kept, its reservation dropped) until a raised cap reopens the category.
local function hold(s, now)
  drop_inflight(s)
  redis.call('ZREM', K.leases, s)
  redis.call('ZADD', K.parked, now, s)
end

-- reject(s, reason, json): s ends rejected (counted per reason) and its dead letter goes to
-- the writer. False if s was final already.
local function reject(s, reason, json)
  if redis.call('HSETNX', K.final, s, 'r:' .. reason) == 0 then return false end
  forget(s)
  redis.call('HINCRBY', K.state, 'rejected', 1)
  redis.call('HINCRBY', K.reasons, reason, 1)
  if reason == 'duplicate_prompt' then redis.call('HINCRBY', K.state, 'dup_prompts', 1) end
  redis.call('XADD', K.dead, '*', 'r', json)
  return true
end

-- reject_each(i, only): the records rejected while reading or rendering, ARGV[i ..] in
-- groups of 3 (sample id, reason, dead-letter JSON): each one `reject`ed, or with `only`, each
-- one for which only(sample id) is true (feed.lua, feed_follow.lua).
local function reject_each(i, only)
  while i <= #ARGV do
    if not only or only(ARGV[i]) then reject(ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
    i = i + 3
  end
end

-- count_mode(mode, counted): a committed sample of decode mode `mode` ('' : none), of
-- `counted` tokens, in the per-mode counters (`modes`: `<mode> rows`, `<mode> tokens`).
local function count_mode(mode, counted)
  if mode and mode ~= '' then
    redis.call('HINCRBY', K.modes, mode .. ' rows', 1)
    redis.call('HINCRBY', K.modes, mode .. ' tokens', counted)
  end
end

-- count_reply(reason, tokens): a committed reply's output tokens, in a training row (reason
-- '': `kept`) or kept out of training by the reply gate (`gated:<reason>` tokens and
-- `gated_n:<reason>` replies in the state hash).
local function count_reply(reason, tokens)
  if reason == '' then
    redis.call('HINCRBY', K.state, 'kept', tokens)
  else
    redis.call('HINCRBY', K.state, 'gated:' .. reason, tokens)
    redis.call('HINCRBY', K.state, 'gated_n:' .. reason, 1)
  end
end

-- The admission rule, the only copy (admit.lua and unpark.lua use it).
-- fits(st, est, est_var, max_add, z): may one more sample be sent now? st is the state
-- {cap, used, reserved, var, worst}, est the sample's reservation (tokens), est_var its
-- variance (tokens^2), max_add the most it can add (0: no hard guard), z the margin in
-- standard deviations. Yes while used < cap and
--   (expected) used + reserved + est + z * sqrt(var + est_var) < cap, or nothing is in flight
--              (so a category never stops below its cap), and
--   (hard)     used + worst < cap, worst = the sum of what in-flight samples can still add,
-- so `used` ends below cap + one sample's maximum.
local function fits(st, est, est_var, max_add, z)
  if st.used >= st.cap then return false end
  local margin = z * math.sqrt(math.max(0, st.var + est_var))
  local expected_ok = (st.used + st.reserved + est + margin < st.cap) or st.reserved == 0
  local hard_ok = max_add == 0 or st.used + st.worst < st.cap
  return expected_ok and hard_ok
end

-- reserve(st, s, est, est_var, max_add): admission took sample s: hold est tokens (variance
-- est_var, at most max_add; 0 = no hard guard) for it in the ledger and in st, the state
-- `budget()` read. The only copy (admit.lua and unpark.lua take samples with it).
local function reserve(st, s, est, est_var, max_add)
  redis.call('HSET', K.reserved, s, est)
  redis.call('HINCRBY', K.state, 'reserved', est)
  st.reserved = st.reserved + est
  if est_var > 0 then
    redis.call('HSET', K.var, s, est_var)
    redis.call('HINCRBY', K.state, 'var', est_var)
    st.var = st.var + est_var
  end
  if max_add > 0 then
    redis.call('HSET', K.worst, s, max_add)
    redis.call('HINCRBY', K.state, 'worst', max_add)
    st.worst = st.worst + max_add
  end
end

-- with_extra(est, max_add, extra): a sample's own ask: the category's estimate and the most
-- it can add (0: no hard guard), each with the prompt tokens it counts (`extra`, count =
-- "total"). The only copy (admit.lua and unpark.lua ask with it).
local function with_extra(est, max_add, extra)
  if max_add > 0 then max_add = max_add + extra end
  return est + extra, max_add
end

-- budget(): the state fields admission reads, as numbers, and whether the category is closed.
local function budget()
  local raw = redis.call('HMGET', K.state, 'cap', 'used', 'reserved', 'var', 'worst', 'closed')
  return {cap = cap_of(raw[1]) or 0, used = tonumber(raw[2]) or 0,
          reserved = tonumber(raw[3]) or 0, var = tonumber(raw[4]) or 0,
          worst = tonumber(raw[5]) or 0}, raw[6] == '1'
end

-- seq_of(s): how many times s was enqueued again (0 when never).
local function seq_of(s)
  return tonumber(redis.call('HGET', K.seq, s) or '0')
end

-- behind(bound): has the writer `bound` (> 0) or more of the category's results and dead
-- letters still to write? Then nothing more is sent until it catches up.
local function behind(bound)
  if not bound or bound <= 0 then return false end
  return redis.call('XLEN', K.results) + redis.call('XLEN', K.dead) >= bound
end

-- turn_events(i): apply the conversation events in ARGV[i ..] (acknowledge.lua, restore.lua):
--   'next', turn sample id, its output ids (JSON), the next turn's sample id, ordinal, the
--           engine that served the turn (or ''): keep the output; the next turn waits in
--           `follow` (with the engine it prefers) unless it is pending or final
--   'end', k, k history fields to drop
-- Returns nil, or an error reply for an unknown event.
local function turn_events(i)
  while i <= #ARGV do
    if ARGV[i] == 'next' then
      local nxt = ARGV[i + 3]
      redis.call('HSET', K.history, ARGV[i + 1], ARGV[i + 2])
      if unseen(nxt) then
        redis.call('ZADD', K.follow, 'NX', ARGV[i + 4], nxt)
        if ARGV[i + 5] ~= '' then redis.call('HSET', K.engine_of, nxt, ARGV[i + 5]) end
      end
      i = i + 6
    elseif ARGV[i] == 'end' then
      local k = tonumber(ARGV[i + 1])
      for j = i + 2, i + 1 + k do redis.call('HDEL', K.history, ARGV[j]) end
      i = i + 2 + k
    else
      return redis.error_reply('unknown conversation event ' .. tostring(ARGV[i]))
    end
  end
  return nil
end
