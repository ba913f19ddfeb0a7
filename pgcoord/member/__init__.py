"""``Member``: one process's presence in a database, its session and its watcher."""

from .info import MemberChange, MemberInfo, MemberJoined, MemberLeft, NameTaken
from .member import Member, MemberWatch
from .session import MemberSession, SessionLost

__all__ = ["Member", "MemberChange", "MemberInfo", "MemberJoined", "MemberLeft", "MemberSession",
           "MemberWatch", "NameTaken", "SessionLost"]
