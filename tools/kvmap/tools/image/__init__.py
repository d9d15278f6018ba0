"""The kvmapd image against what the Kubernetes manifests expect of it: the
parts of ``python -m kvmap.tools.image_check`` (``kvmap.tools.image_check``
has the command line and the whole story).

``facts`` (the image: its configuration and recorded path facts),
``manifests`` (the rendered kustomizations and their kvmapd sidecars),
``expectations`` (what the sidecar's container runs and writes), ``checks``
(the comparison), ``record`` (the facts JSON of a built image) and ``pod``
(the sidecar as the kubelet would start it, as a bash script).
"""

from typing import Any

Doc = dict[str, Any]  # a parsed JSON or YAML document
