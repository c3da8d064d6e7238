"""Transport: NIXL (UCX) data plane and a ucxx control plane between producer and consumer.

Import the pieces from their modules (:mod:`.endpoint`, :mod:`.dataplane`,
:mod:`.memory`); nothing here imports NIXL or ucxx at package import time.
"""
