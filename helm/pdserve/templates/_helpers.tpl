{{/* Names */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Room is left for the longest component suffix ("-registry", "-planner", "-loadtest-NNN"). */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels. Call with (dict "root" $ "component" "router"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.plannerServiceAccountName" -}}
{{- printf "%s-planner" (include "pdserve.fullname" .) }}
{{- end }}

{{/* Secrets */}}
{{- define "pdserve.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- printf "%s-secrets" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* The EnvVar (as JSON, for fromJson) giving a container PDSERVE_REGISTRY_TOKEN from the chart's Secret. */}}
{{- define "pdserve.registryTokenEnv" -}}
{{- dict "name" "PDSERVE_REGISTRY_TOKEN" "valueFrom" (dict "secretKeyRef" (dict "name" (include "pdserve.secretName" .) "key" .Values.secrets.registryTokenKey)) | toJson }}
{{- end }}

{{- define "pdserve.hasApiKeys" -}}
{{- if or .Values.secrets.existingSecret .Values.secrets.apiKeys }}true{{- end }}
{{- end }}

{{/* Redis */}}
{{- define "pdserve.redisHost" -}}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.redisPasswordSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else }}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pdserve.redisUrlSecretName" -}}
{{- if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- printf "%s-redis-url" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* In-chart Redis without a password: the URL is plain configuration (the ConfigMap carries it). */}}
{{- define "pdserve.redisUrlInConfigMap" -}}
{{- if and .Values.redis.enabled (not .Values.redis.auth.enabled) }}true{{- end }}
{{- end }}

{{/* Env entries that give a pdserve container PDSERVE_REDIS_URL (unless the ConfigMap does). */}}
{{- define "pdserve.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisPasswordSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretPasswordKey }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "pdserve.redisHost" .) | quote }}
{{- end }}
{{- else }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisUrlSecretName" . }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Service URLs */}}
{{- define "pdserve.registryUrl" -}}
{{- printf "http://%s-registry:%d" (include "pdserve.fullname" .) (int .Values.registry.port) }}
{{- end }}

{{- define "pdserve.routerUrl" -}}
{{- printf "http://%s-router:%d" (include "pdserve.fullname" .) (int .Values.router.service.port) }}
{{- end }}

{{/* Does this tier's replica count belong to an autoscaler? Call with (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.autoscaled" -}}
{{- if and (ne .root.Values.autoscaling.mode "none") (has .component (list "prefill" "decode")) }}true{{- end }}
{{- end }}

{{/*
A pdserve Deployment. Call with a dict:
  root       the top context ($)
  component  router | registry | prefill | decode | planner
  cfg        the tier's values (.Values.<component>)
  ports      list of (dict "name" "containerPort")
  env        extra EnvVar list for this tier (already a list of dicts)
  secretChecksum  (optional) a digest of the chart-managed secret values the tier reads: pods roll when it changes
  lifecycle  (optional) the container's lifecycle hooks
  serviceAccountName
*/}}
{{- define "pdserve.deployment" -}}
{{- $root := .root -}}
{{- $cfg := .cfg -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.fullname" $root }}-{{ .component }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not (include "pdserve.autoscaled" $ctx) }}
  replicas: {{ hasKey $cfg "replicaCount" | ternary $cfg.replicaCount 1 }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with .strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  template:
    {{- include "pdserve.podTemplate" . | nindent 4 }}
{{- end }}

{{/*
A pdserve pod template (metadata + spec): a Deployment's pods, a LeaderWorkerSet's leader and worker pods.
Call with the dict of pdserve.deployment, plus optionally:
  container   the container's name (default: component)
  args        the container's args (default: [component])
  ranks       tensor-parallel ranks in this pod; on cuda with tensorParallelSize > 1, its GPUs (default: the
              tier's tensorParallelSize)
  rankWorker  true for a LeaderWorkerSet's worker pod (`pdserve tp-worker`): no HTTP server (no probes), no Redis
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root -}}
{{- $cfg := .cfg -}}
{{- $ctx := dict "root" $root "component" .component -}}
{{- $ranks := int (.ranks | default ($cfg.tensorParallelSize | default 1)) -}}
metadata:
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
    {{- with $cfg.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Roll the pods when the configuration they read changes.
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with .secretChecksum }}
    # ...and when the chart-managed secrets they read change (an API key rotated with helm upgrade).
    checksum/secrets: {{ . }}
    {{- end }}
    {{- with $cfg.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ .serviceAccountName }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds | default 30 }}
  containers:
    - name: {{ .container | default .component }}
      image: {{ include "pdserve.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args: {{ .args | default (list .component) | toJson }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      {{- with .ports }}
      ports:
        {{- range . }}
        - name: {{ .name }}
          containerPort: {{ .containerPort }}
          protocol: TCP
        {{- end }}
      {{- end }}
      envFrom:
        - configMapRef:
            name: {{ include "pdserve.fullname" $root }}-config
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # Other pods reach this one on its IP (KV transfer, registry entries).
        - name: PDSERVE_ADVERTISE_HOST
          value: $(POD_IP)
        - name: PDSERVE_PORT
          value: {{ $cfg.port | quote }}
        {{- if not .rankWorker }}
        {{- with (include "pdserve.redisEnv" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $cfg.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if not .rankWorker }}
      startupProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $root.Values.probes.startup.periodSeconds }}
        failureThreshold: {{ $root.Values.probes.startup.failureThreshold }}
        timeoutSeconds: {{ $root.Values.probes.startup.timeoutSeconds }}
      readinessProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $root.Values.probes.readiness.periodSeconds }}
        failureThreshold: {{ $root.Values.probes.readiness.failureThreshold }}
        timeoutSeconds: {{ $root.Values.probes.readiness.timeoutSeconds }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $root.Values.probes.liveness.periodSeconds }}
        failureThreshold: {{ $root.Values.probes.liveness.failureThreshold }}
        timeoutSeconds: {{ $root.Values.probes.liveness.timeoutSeconds }}
      {{- end }}
      {{- /* tensor parallelism on GPUs: one GPU per rank of this pod */}}
      {{- $res := deepCopy ($cfg.resources | default dict) }}
      {{- if and (eq (toString $root.Values.engine.device) "cuda") (gt (int ($cfg.tensorParallelSize | default 1)) 1) }}
      {{- $limits := merge (dict "nvidia.com/gpu" $ranks) (omit ($res.limits | default dict) "nvidia.com/gpu") }}
      {{- $_ := set $res "limits" $limits }}
      {{- end }}
      resources:
        {{- toYaml $res | nindent 8 }}
      {{- with .lifecycle }}
      lifecycle:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if and $cfg.shm $cfg.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- if and (has .component (list "prefill" "decode")) $root.Values.model.volume.enabled }}
        - name: model
          mountPath: {{ $root.Values.model.volume.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and (has .component (list "prefill" "decode")) $root.Values.engine.kvOffloading.disk.enabled }}
        - name: kv-offload
          mountPath: {{ $root.Values.engine.kvOffloading.disk.mountPath }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if and $cfg.shm $cfg.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        {{- with $cfg.shm.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- end }}
    {{- if and (has .component (list "prefill" "decode")) $root.Values.model.volume.enabled }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ required "model.volume.existingClaim is required when model.volume.enabled" $root.Values.model.volume.existingClaim }}
        readOnly: true
    {{- end }}
    {{- with $root.Values.engine.kvOffloading.disk }}
    {{- if and (has $.component (list "prefill" "decode")) .enabled }}
    - name: kv-offload
      {{- if .existingClaim }}
      persistentVolumeClaim:
        claimName: {{ .existingClaim }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ printf "%dMi" (add (mulf .size 1024 | int) 64) }}
      {{- end }}
    {{- end }}
    {{- end }}
  {{- with $cfg.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* A PodDisruptionBudget for a tier. Call with (dict "root" $ "component" "router" "cfg" .Values.router). */}}
{{- define "pdserve.pdb" -}}
{{- if .cfg.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdserve.fullname" .root }}-{{ .component }}
  labels:
    {{- include "pdserve.labels" . | nindent 4 }}
spec:
  {{- if hasKey .cfg.pdb "minAvailable" }}
  minAvailable: {{ .cfg.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .cfg.pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* Checks JSON Schema cannot express: min <= max per autoscaled tier. */}}
{{- define "pdserve.validateAutoscaling" -}}
{{- range $tier := list "prefill" "decode" }}
{{- $t := index $.Values.autoscaling $tier }}
{{- if gt (int $t.minReplicas) (int $t.maxReplicas) }}
{{- fail (printf "autoscaling.%s.minReplicas (%d) must not exceed maxReplicas (%d)" $tier (int $t.minReplicas) (int $t.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
