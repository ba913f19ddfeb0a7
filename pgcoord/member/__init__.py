"""``Member``: one process's presence in a database, its session and its watcher."""

from .member import Member, MemberInfo, MemberJoined, MemberLeft, MemberSession, NameTaken, SessionLost

__all__ = ["Member", "MemberInfo", "MemberJoined", "MemberLeft", "MemberSession", "NameTaken",
           "SessionLost"]
