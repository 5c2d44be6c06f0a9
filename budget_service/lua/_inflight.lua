-- _inflight.lua: prepended to the scripts that end a sample's time in flight.
-- drop_inflight(state, s, reserved, worst, var): remove sample s from the per-sample hashes
-- `reserved` (its estimate), `worst` (the most it can add) and `var` (the variance of what
-- it will add), and subtract each from the state total of the same name.
local function drop_inflight(state, s, reserved, worst, var)
  for field, key in pairs({reserved = reserved, worst = worst, var = var}) do
    local raw = redis.call('HGET', key, s)
    if raw then
      redis.call('HDEL', key, s)
      local v = tonumber(raw)
      -- never `-0`: HINCRBY refuses it as "not an integer"
      if v ~= 0 then redis.call('HINCRBY', state, field, -v) end
    end
  end
end
