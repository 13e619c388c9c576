"""twistd plugins: ``twistd waltz-storage`` and ``twistd waltz-server``.

Each plugin is a lazy ServiceMaker: nothing of Waltz is imported until twistd runs it.
"""

from twisted.application.service import ServiceMaker

waltz_storage = ServiceMaker(
    "Waltz Storage", "waltz.storage.tap", "A Waltz storage node: keeps replicas of log partitions.",
    "waltz-storage")

waltz_server = ServiceMaker(
    "Waltz Server", "waltz.server.tap",
    "A Waltz server: serves clients their partitions, replicating to the storage nodes.", "waltz-server")
