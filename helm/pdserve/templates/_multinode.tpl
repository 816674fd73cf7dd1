{{/*
A prefill or decode tier's workload: its Deployment, or with <tier>.multiNode.enabled a LeaderWorkerSet
(leaderworkerset.x-k8s.io/v1) whose every replica is a group of multiNode.nodes pods running one
tensor-parallel engine. Call with the dict of pdserve.deployment.

The group: the leader pod (worker index 0) is the tier's pod as a Deployment would run it (same labels, so the
tier's Service, PodDisruptionBudget and NetworkPolicy select it; probes; the KV port), started with --nnodes and
holding the ranks' rendezvous on multiNode.masterPort. The worker pods (indices 1..nodes-1) run
`pdserve tp-worker --node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)`: LWS puts those variables
in every container of the group; Kubernetes expands $(VAR) in args. They carry the component label
<tier>-worker, so nothing that looks for the tier's pods (Service endpoints, the planner, the router) finds them.
Each pod runs tensorParallelSize / nodes ranks and, on cuda, as many GPUs.
*/}}
{{- define "pdserve.tierWorkload" -}}
{{- if and .cfg.multiNode .cfg.multiNode.enabled }}
{{- include "pdserve.leaderWorkerSet" . }}
{{- else }}
{{- include "pdserve.deployment" . }}
{{- end }}
{{- end }}

{{/* Whether a tier runs as a LeaderWorkerSet. Call with (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.multiNode" -}}
{{- $cfg := index .root.Values .component -}}
{{- if and $cfg.multiNode $cfg.multiNode.enabled }}true{{- end }}
{{- end }}

{{/* scaleTargetRef (HPA, KEDA) of a tier's workload. Call with (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.scaleTargetRef" -}}
{{- if include "pdserve.multiNode" . }}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else }}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "pdserve.fullname" .root }}-{{ .component }}
{{- end }}

{{- define "pdserve.leaderWorkerSet" -}}
{{- $root := .root -}}
{{- $cfg := .cfg -}}
{{- $mn := $cfg.multiNode -}}
{{- $ctx := dict "root" $root "component" .component -}}
{{- $tp := int ($cfg.tensorParallelSize | default 1) -}}
{{- $nodes := int $mn.nodes -}}
{{- if or (lt $nodes 2) (lt $tp $nodes) (ne (mod $tp $nodes) 0) }}
{{- fail (printf "%s.multiNode.nodes (%d) must be at least 2 and divide %s.tensorParallelSize (%d): every pod of a group runs the same number of ranks" .component $nodes .component $tp) }}
{{- end }}
{{- $port := int $mn.masterPort -}}
{{- $join := dict "name" "PDSERVE_TP_JOIN_TIMEOUT_S" "value" (toString $mn.joinTimeoutSeconds) -}}
{{- $leader := dict -}}
{{- $worker := dict -}}
{{- range $k, $v := . }}{{ $_ := set $leader $k $v }}{{ $_ := set $worker $k $v }}{{ end -}}
{{- $_ := set $leader "ranks" (div $tp $nodes) -}}
{{- $_ := set $leader "ports" (append .ports (dict "name" "rendezvous" "containerPort" $port)) -}}
{{- $_ := set $leader "env" (concat .env (list (dict "name" "PDSERVE_NNODES" "value" (toString $nodes)) (dict "name" "PDSERVE_MASTER_PORT" "value" (toString $port)) $join)) -}}
{{- $_ := set $worker "component" (printf "%s-worker" .component) -}}
{{- $_ := set $worker "ranks" (div $tp $nodes) -}}
{{- $_ := set $worker "rankWorker" true -}}
{{- $_ := set $worker "ports" list -}}
{{- $_ := set $worker "env" (list $join) -}}
{{- $_ := set $worker "lifecycle" nil -}}
{{- $_ := set $worker "secretChecksum" nil -}}
{{- $_ := set $worker "args" (list "tp-worker" "--node-rank=$(LWS_WORKER_INDEX)" "--master-addr=$(LWS_LEADER_ADDRESS)" (printf "--master-port=%d" $port)) -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "pdserve.fullname" $root }}-{{ .component }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not (include "pdserve.autoscaled" $ctx) }}
  replicas: {{ hasKey $cfg "replicaCount" | ternary $cfg.replicaCount 1 }}
  {{- end }}
  # workers start once their leader pod exists; they wait for its rendezvous up to joinTimeoutSeconds
  startupPolicy: LeaderCreated
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration:
      maxUnavailable: 1
      maxSurge: 0
  leaderWorkerTemplate:
    size: {{ $nodes }}
    # one engine spans the group: any pod (or container) restart recreates all of them
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      {{- include "pdserve.podTemplate" $leader | nindent 6 }}
    workerTemplate:
      {{- include "pdserve.podTemplate" $worker | nindent 6 }}
{{- end }}
