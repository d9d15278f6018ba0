#!/usr/bin/env bash
# upgrade-sidecar.sh: move the kvmapd sidecar of a Deployment's running pods
# to a new image WITHOUT restarting vLLM, then make the Deployment (and its
# current ReplicaSet) create new pods with that image too, without a rollout.
#
#   upgrade-sidecar.sh -d prefill-vllm -i ghcr.io/kvmap/kvmapd:0.2.0 [-n NAMESPACE]
#
# Why not just `kubectl set image deployment/...`: any change to a Deployment's
# pod template makes a new ReplicaSet and REPLACES every pod, so vLLM restarts
# (model reload, KV cache lost). A Pod's initContainers[*].image, however, is
# mutable, and for a restartable init container the kubelet restarts only that
# container (Kubernetes >= 1.32; older kubelets update the spec but keep the
# old container running until it exits, so this script then stops the daemon
# itself with SIGTERM and the kubelet starts the new image).
#
# Steps (one pod at a time; stops at the first problem):
#   1. preflight: the Deployment is fully rolled out and not paused; all its
#      pods belong to its current ReplicaSet.
#   2. per pod: patch the sidecar image; wait until the sidecar has restarted
#      and is ready again; check that vLLM's restartCount and start time did
#      not change.
#   3. template (skip with --skip-template): pause the Deployment, patch the
#      current ReplicaSet's template and the Deployment's template identically,
#      check they are equal, resume. The Deployment controller finds its
#      current ReplicaSet by comparing templates (ignoring pod-template-hash),
#      still finds the same one, and rolls nothing. Then check that no other
#      ReplicaSet got replicas.
#
# Needs kubectl with get/patch on pods, replicasets and deployments, exec on
# pods, and get on nodes (for the kubelet version). No jq.
set -euo pipefail

NAMESPACE=""
DEPLOYMENT=""
IMAGE=""
SIDECAR="kvmapd"
MAIN="vllm"
TIMEOUT=600
SKIP_TEMPLATE=0
DRY_RUN=0
POLL=${KVMAP_UPGRADE_POLL_SECONDS:-2}

usage() {
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
Options:
  -d, --deployment NAME   Deployment whose pods to upgrade (required)
  -i, --image IMAGE       new kvmapd image (required)
  -n, --namespace NS      namespace (default: the kubeconfig context's)
      --sidecar NAME      sidecar container name (default kvmapd)
      --main NAME         vLLM container name (default vllm)
      --timeout SECONDS   per-pod wait for the new sidecar to be ready (default 600)
      --skip-template     patch the pods only; leave the Deployment/ReplicaSet alone
      --dry-run           print the changing commands instead of running them
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    -d | --deployment) DEPLOYMENT=$2; shift 2 ;;
    -i | --image) IMAGE=$2; shift 2 ;;
    -n | --namespace) NAMESPACE=$2; shift 2 ;;
    --sidecar) SIDECAR=$2; shift 2 ;;
    --main) MAIN=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --skip-template) SKIP_TEMPLATE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$DEPLOYMENT" ] || [ -z "$IMAGE" ]; then
  usage >&2
  exit 2
fi

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

k() {
  if [ -n "$NAMESPACE" ]; then kubectl -n "$NAMESPACE" "$@"; else kubectl "$@"; fi
}
# Commands that change the cluster go through here (printed with --dry-run).
change() {
  if [ "$DRY_RUN" = 1 ]; then
    printf 'DRY-RUN: kubectl%s' "${NAMESPACE:+ -n $NAMESPACE}" >&2
    printf ' %q' "$@" >&2
    printf '\n' >&2
  else
    k "$@"
  fi
}
jp() { k get "$1" "$2" -o "jsonpath=$3"; }  # jp KIND NAME EXPRESSION

SIDE_STATUS="{.status.initContainerStatuses[?(@.name==\"$SIDECAR\")]"
MAIN_STATUS="{.status.containerStatuses[?(@.name==\"$MAIN\")]"
POD_PATCH="{\"spec\":{\"initContainers\":[{\"name\":\"$SIDECAR\",\"image\":\"$IMAGE\"}]}}"
TEMPLATE_PATCH="{\"spec\":{\"template\":$POD_PATCH}}"

# Stops kvmapd inside its container (pre-1.32 kubelets): the daemon drains and
# exits 0, and the kubelet starts the container again from the patched spec.
# Runs as the sidecar's user, so it cannot signal vLLM's processes anyway.
KICK='import os, signal
me = os.getpid()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if int(pid) != me and b"serve" in argv and any(a.rsplit(b"/", 1)[-1] == b"kvmapd" for a in argv[:2]):
        os.kill(int(pid), signal.SIGTERM)
        print("SIGTERM", pid)'

kick() {
  kicks=$((kicks + 1))
  k exec "$1" -c "$SIDECAR" -- python -c "$KICK" >&2 || log "pod/$1: exec failed (the container may be restarting already)"
}
# The kubelet reports the image as the runtime resolved it ("kvmapd:1" may read
# "docker.io/library/kvmapd:1"): compare names, allowing a registry prefix.
image_matches() {
  case "$1" in "$IMAGE" | */"$IMAGE") return 0 ;; *) return 1 ;; esac
}

# ---- 1. preflight
IFS='|' read -r gen observed want updated ready paused < <(
  jp deployment "$DEPLOYMENT" '{.metadata.generation}|{.status.observedGeneration}|{.spec.replicas}|{.status.updatedReplicas}|{.status.readyReplicas}|{.spec.paused}{"\n"}'
) || die "cannot read deployment/$DEPLOYMENT"
if [ "${paused:-}" = "true" ]; then die "deployment/$DEPLOYMENT is paused: someone else is changing it"; fi
if [ "$gen" != "$observed" ] || [ "$want" != "${updated:-0}" ]; then
  die "deployment/$DEPLOYMENT is still rolling out (generation $gen/$observed, updated ${updated:-0}/$want)"
fi
if [ "${ready:-0}" != "$want" ]; then log "warning: only ${ready:-0}/$want pods are ready"; fi

selector=$(jp deployment "$DEPLOYMENT" '{.spec.selector.matchLabels}' | sed -e 's/[{}"]//g' -e 's/:/=/g')
[ -n "$selector" ] || die "deployment/$DEPLOYMENT has no matchLabels selector"

pods=()
owners=()
while read -r pod owner; do
  [ -n "$pod" ] || continue
  pods+=("$pod")
  owners+=("$owner")
done < <(k get pods -l "$selector" -o 'jsonpath={range .items[*]}{.metadata.name} {.metadata.ownerReferences[0].name}{"\n"}{end}')
[ "${#pods[@]}" -gt 0 ] || die "no pods match $selector"
rs=${owners[0]}
for owner in "${owners[@]}"; do
  [ "$owner" = "$rs" ] || die "pods belong to several ReplicaSets ($rs, $owner): finish the rollout first"
done
[ "$(jp rs "$rs" '{.metadata.ownerReferences[0].name}')" = "$DEPLOYMENT" ] ||
  die "replicaset/$rs is not owned by deployment/$DEPLOYMENT"
[ "$(jp rs "$rs" '{.spec.template.spec}')" = "$(jp deployment "$DEPLOYMENT" '{.spec.template.spec}')" ] ||
  die "replicaset/$rs does not match the deployment's template: finish the rollout first"
log "deployment/$DEPLOYMENT: ${#pods[@]} pod(s) of replicaset/$rs -> $SIDECAR image $IMAGE"

# ---- 2. pods, one at a time
for pod in "${pods[@]}"; do
  current=$(jp pod "$pod" "{.spec.initContainers[?(@.name==\"$SIDECAR\")].image}")
  [ -n "$current" ] || die "pod/$pod has no init container $SIDECAR"
  if [ "$current" = "$IMAGE" ]; then
    log "pod/$pod: already on $IMAGE"
    continue
  fi
  side_restarts=$(jp pod "$pod" "$SIDE_STATUS.restartCount}")
  main_before=$(jp pod "$pod" "$MAIN_STATUS.restartCount}|$MAIN_STATUS.state.running.startedAt}")
  node=$(jp pod "$pod" '{.spec.nodeName}')
  kubelet=$(k get node "$node" -o 'jsonpath={.status.nodeInfo.kubeletVersion}')
  minor=$(printf '%s' "$kubelet" | sed -E 's/^v?[0-9]+\.([0-9]+).*/\1/')
  case "$minor" in '' | *[!0-9]*) minor=0 ;; esac # unknown: treat as old
  log "pod/$pod: $current -> $IMAGE (node $node, kubelet $kubelet, $MAIN restarts|startedAt $main_before)"

  change patch pod "$pod" --type=strategic -p "$POD_PATCH"
  if [ "$DRY_RUN" = 1 ]; then
    if [ "$minor" -lt 32 ]; then change exec "$pod" -c "$SIDECAR" -- python -c "$KICK"; fi
    continue
  fi
  kicks=0
  if [ "$minor" -lt 32 ]; then
    log "pod/$pod: kubelet $kubelet does not restart a sidecar on an image change; stopping kvmapd"
    kick "$pod"
  fi

  deadline=$((SECONDS + TIMEOUT))
  while :; do
    IFS='|' read -r restarts sready simage < <(
      jp pod "$pod" "$SIDE_STATUS.restartCount}|$SIDE_STATUS.ready}|$SIDE_STATUS.image}{\"\\n\"}"
    ) || true
    if [ "${restarts:-0}" -gt "$side_restarts" ] && [ "${sready:-}" = "true" ]; then
      image_matches "$simage" && break
      # An old kubelet restarted the container before it saw the new spec.
      if [ "$minor" -lt 32 ] && [ "$kicks" -lt 3 ]; then
        log "pod/$pod: $SIDECAR came back on $simage, not $IMAGE; stopping it again"
        side_restarts=$restarts
        kick "$pod"
      else
        die "pod/$pod: $SIDECAR restarted but runs $simage, not $IMAGE"
      fi
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      die "pod/$pod: $SIDECAR not restarted and ready after ${TIMEOUT}s (restarts ${restarts:-?}, ready ${sready:-?}).
  Inspect: kubectl describe pod $pod; kubectl logs $pod -c $SIDECAR
  Roll this pod back: kubectl patch pod $pod --type=strategic -p '{\"spec\":{\"initContainers\":[{\"name\":\"$SIDECAR\",\"image\":\"$current\"}]}}'"
    fi
    sleep "$POLL"
  done
  main_after=$(jp pod "$pod" "$MAIN_STATUS.restartCount}|$MAIN_STATUS.state.running.startedAt}")
  [ "$main_after" = "$main_before" ] ||
    die "pod/$pod: $MAIN restarted during the upgrade ($main_before -> $main_after); stopping"
  log "pod/$pod: $SIDECAR restarted on $IMAGE and ready; $MAIN untouched ($main_after)"
done

# ---- 3. templates
if [ "$SKIP_TEMPLATE" = 1 ]; then
  log "--skip-template: new pods of deployment/$DEPLOYMENT still get the old $SIDECAR image"
  exit 0
fi
change rollout pause "deployment/$DEPLOYMENT"
change patch rs "$rs" --type=strategic -p "$TEMPLATE_PATCH"
change patch deployment "$DEPLOYMENT" --type=strategic -p "$TEMPLATE_PATCH"
if [ "$DRY_RUN" = 0 ] &&
  [ "$(jp rs "$rs" '{.spec.template.spec}')" != "$(jp deployment "$DEPLOYMENT" '{.spec.template.spec}')" ]; then
  die "replicaset/$rs and deployment/$DEPLOYMENT templates differ after patching; the Deployment
  is LEFT PAUSED (resuming now would replace every pod). Compare:
    kubectl get rs $rs -o jsonpath='{.spec.template.spec}'
    kubectl get deployment $DEPLOYMENT -o jsonpath='{.spec.template.spec}'"
fi
change rollout resume "deployment/$DEPLOYMENT"
if [ "$DRY_RUN" = 1 ]; then exit 0; fi

deadline=$((SECONDS + 60))
while :; do
  IFS='|' read -r gen observed < <(jp deployment "$DEPLOYMENT" '{.metadata.generation}|{.status.observedGeneration}{"\n"}')
  if [ "$gen" = "$observed" ]; then break; fi
  [ "$SECONDS" -lt "$deadline" ] || die "deployment/$DEPLOYMENT not observed after resume (generation $gen/$observed)"
  sleep "$POLL"
done
while read -r name replicas; do
  [ -z "$name" ] || [ "$name" = "$rs" ] || [ "${replicas:-0}" = 0 ] ||
    die "replicaset/$name has $replicas replicas: the Deployment is ROLLING the pods.
  Stop it with: kubectl rollout pause deployment/$DEPLOYMENT"
done < <(k get rs -l "$selector" -o 'jsonpath={range .items[*]}{.metadata.name} {.spec.replicas}{"\n"}{end}')
log "deployment/$DEPLOYMENT and replicaset/$rs now create pods with $IMAGE; no rollout happened"
