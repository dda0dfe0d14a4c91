"""The least privilege the backend needs: the commands it sends and the keys it touches, as
Redis ACL rules (docs/operations.md lists them; the tests run the conformance suite as a user
with exactly these rules, so a command missing here fails a test).

Redis 7 checks the commands a Lua script calls against the caller's ACL too, so the list has
the scripts' commands as well as the ones sent directly. ``INFO`` and ``CONFIG GET`` are not
needed: without them the start-up and ``icefloe doctor`` persistence checks say they could not
verify the server's persistence instead of checking it.
"""

from __future__ import annotations

#: commands sent directly (redis-py runs scripts with EVALSHA, loading them with SCRIPT LOAD)
DIRECT_COMMANDS = (
    "ping",
    "evalsha",
    "script|load",
    "get",
    "set",
    "pttl",
    "hkeys",
    "hgetall",
    "xread",
    "xrevrange",
)

#: commands the Lua scripts of :mod:`icefloe_redis.scripts` call
SCRIPT_COMMANDS = (
    "time",
    "exists",
    "get",
    "set",
    "del",
    "incr",
    "incrby",
    "pexpire",
    "pttl",
    "hexists",
    "hget",
    "hset",
    "hincrby",
    "zadd",
    "zscore",
    "zrangebyscore",
    "zremrangebyscore",
    "xadd",
    "xtrim",
    "xinfo|stream",
)

#: with ``cluster = true``: redis-py's cluster client reads the slot map and asks the server
#: which arguments of a command are keys (COMMAND, COMMAND GETKEYS) to route it
CLUSTER_COMMANDS = ("cluster|slots", "command")

#: optional: let the persistence checks read the server's settings
DOCTOR_COMMANDS = ("info", "config|get")


def acl_rules(key_prefix: str = "icefloe", *, cluster: bool = False, doctor: bool = False) -> str:
    """The ACL rules (for ``ACL SETUSER <user> on >password <rules>`` or a ``user`` line of an
    ACL file) that let a user run the backend under ``key_prefix`` and do nothing else: no
    other keys, no Pub/Sub channels, no other commands. ``cluster`` adds what the cluster
    client needs, ``doctor`` INFO and CONFIG GET."""
    commands: tuple[str, ...] = DIRECT_COMMANDS + SCRIPT_COMMANDS
    commands += (CLUSTER_COMMANDS if cluster else ()) + (DOCTOR_COMMANDS if doctor else ())
    granted = " ".join(f"+{c}" for c in dict.fromkeys(commands))
    return f"resetkeys ~{key_prefix}:* resetchannels -@all {granted}"
