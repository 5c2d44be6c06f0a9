-- restore.lua: put back conversations' next turns and the output ids of their earlier turns,
-- found in the files after Redis lost them (the producer's reconcile at start): the same
-- conversation events the writer's acknowledge carries, with no stream entry to ack.
-- KEYS: the category's keys (_lib.lua)
-- ARGV: conversation events (`turn_events` in _lib.lua)
-- Returns 0.
local bad = turn_events(1)
if bad then return bad end
return 0
