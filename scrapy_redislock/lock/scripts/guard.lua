-- guard: notice a restart of Redis before a blocking wait reads a slot with a plain XREADGROUP. A client sends it
-- on a waiting connection before that connection's first read of this lock, so nothing is ever handed out by a
-- server run that has not checked the lock (check_restart in _lib.lua).
-- KEYS[1] slots stream, KEYS[2] meta hash
-- ARGV[1] '1' if Redis loses no acknowledged write (durable: the lock is kept as it is)
-- Returns 1 when the lock was recreated with every slot reserved for one lease, else 0 (a missing lock is left
-- missing: the read that follows fails with NOGROUP and the caller sets the lock up again).
return check_restart(KEYS[1], KEYS[2], ARGV[1]) and 1 or 0
