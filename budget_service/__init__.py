"""The single owner of tokencap's Redis state: key names, Lua scripts, status, HTTP."""
