"""twistd plugins: ``twistd waltz-storage`` (and, once built, ``twistd waltz-server``).

Each plugin is a lazy ServiceMaker: nothing of Waltz is imported until twistd runs it.
"""

from twisted.application.service import ServiceMaker

waltz_storage = ServiceMaker(
    "Waltz Storage", "waltz.storage.tap", "A Waltz storage node: keeps replicas of log partitions.",
    "waltz-storage")
