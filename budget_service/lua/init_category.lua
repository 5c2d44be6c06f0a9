-- init_category.lua: create a category's state (what exists already is kept: caps changed
-- live win) and the writer's consumer group on its two streams.
-- KEYS: the category's keys (_lib.lua)
-- ARGV[1] cap (tokens; '' = leave the state as it is)  ARGV[2] the writer's group
-- Returns 1.
if ARGV[1] ~= '' then
  redis.call('HSETNX', K.state, 'cap', ARGV[1])
  redis.call('HSETNX', K.state, 'used', 0)
  redis.call('HSETNX', K.state, 'reserved', 0)
end
for _, stream in ipairs({K.results, K.dead}) do
  local ok = redis.pcall('XGROUP', 'CREATE', stream, ARGV[2], '0', 'MKSTREAM')
  if type(ok) == 'table' and ok.err and not string.find(ok.err, 'BUSYGROUP', 1, true) then
    return redis.error_reply(ok.err)
  end
end
return 1
