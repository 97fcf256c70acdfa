{{/*
Helpers for the ferrox chart.

Decided here: object names and labels, the image reference, the checks that
values.schema.json cannot express (they compare two values), and the Serve
config that becomes the RayService's serveConfigV2, i.e. the `args` of
ferrox.cluster.app:build_app (ferrox.cluster.config.AppArgs).
Not decided here: defaults of engine/router/ingress settings; AppArgs owns
those, and keys left out of values take AppArgs' defaults.
*/}}

{{/* Chart name, overridable. */}}
{{- define "ferrox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The RayService name. KubeRay refuses RayService names over 47 characters
(it appends a 6-character suffix for the RayCluster and "-serve-svc" to that)
and names that are not DNS-1035 labels.
*/}}
{{- define "ferrox.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ferrox.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that pick this release's Ray pods (the PodMonitor selects by them). */}}
{{- define "ferrox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferrox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ferrox.labels" -}}
helm.sh/chart: {{ include "ferrox.chart" . }}
{{ include "ferrox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferrox
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "ferrox.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* True ("true") when any worker group has GPUs. */}}
{{- define "ferrox.hasGPUWorkers" -}}
{{- $gpu := false }}
{{- range .Values.workerGroups }}
{{- if gt (int (default 0 .gpus)) 0 }}{{ $gpu = true }}{{ end }}
{{- end }}
{{- if $gpu }}true{{ end }}
{{- end }}

{{/*
Checks across values. JSON Schema (values.schema.json) cannot compare one
value with another, so these run while rendering and stop helm with `fail`.
*/}}
{{- define "ferrox.validate" -}}
{{- $a := .Values.serve.autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "serve.autoscaling.minReplicas (%d) must not exceed serve.autoscaling.maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if and $a.enabled (not (kindIs "invalid" $a.initialReplicas)) }}
{{- if or (lt (int $a.initialReplicas) (int $a.minReplicas)) (gt (int $a.initialReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "serve.autoscaling.initialReplicas (%d) must lie within minReplicas..maxReplicas (%d..%d)" (int $a.initialReplicas) (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- $names := dict }}
{{- $gpuCapacity := 0 }}
{{- range .Values.workerGroups }}
{{- if hasKey $names .name }}
{{- fail (printf "workerGroups: the name %q is used twice" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "workerGroups[%s]: minReplicas (%d) must not exceed maxReplicas (%d)" .name (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- $replicas := int (ternary .minReplicas .replicas (kindIs "invalid" .replicas)) }}
{{- if or (lt $replicas (int .minReplicas)) (gt $replicas (int .maxReplicas)) }}
{{- fail (printf "workerGroups[%s]: replicas (%d) must lie within minReplicas..maxReplicas (%d..%d)" .name $replicas (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- /* Without the Ray autoscaler a group keeps its start count of pods. */}}
{{- $pods := ternary (int .maxReplicas) $replicas $.Values.rayAutoscaler.enabled }}
{{- $gpuCapacity = add $gpuCapacity (mul (int (default 0 .gpus)) $pods) }}
{{- end }}
{{- /* Derived actor options put one replica on one GPU: make sure they fit. */}}
{{- if and (not .Values.serve.rayActorOptions) (include "ferrox.hasGPUWorkers" .) }}
{{- $need := ternary (int $a.minReplicas) (int .Values.serve.numReplicas) $a.enabled }}
{{- if gt $need (int $gpuCapacity) }}
{{- $rule := ternary "gpus x maxReplicas" "gpus x replicas, as the Ray autoscaler is off" .Values.rayAutoscaler.enabled }}
{{- fail (printf "the Serve application needs %d GPUs (one per replica) but the worker groups hold at most %d (%s)" $need (int $gpuCapacity) $rule) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.upgradeStrategy.type "NewClusterWithIncrementalUpgrade") (not .Values.rayAutoscaler.enabled) }}
{{- fail "upgradeStrategy.type NewClusterWithIncrementalUpgrade needs rayAutoscaler.enabled (KubeRay refuses it otherwise)" }}
{{- end }}
{{- $c := .Values.model.cache }}
{{- if and $c.enabled $c.create $c.existingClaim }}
{{- fail "model.cache: give existingClaim or create, not both" }}
{{- end }}
{{- end }}

{{/* The PersistentVolumeClaim name for the model cache ("" when none is used). */}}
{{- define "ferrox.cacheClaimName" -}}
{{- $c := .Values.model.cache }}
{{- if $c.enabled }}
{{- if $c.existingClaim }}{{ $c.existingClaim }}{{ else if $c.create }}{{ include "ferrox.fullname" . }}-model-cache{{ end }}
{{- end }}
{{- end }}

{{/*
ray_actor_options for each engine replica: the user's, or one GPU per replica
on GPU worker groups (plus the accelerator type when asked), else one CPU.
*/}}
{{- define "ferrox.rayActorOptions" -}}
{{- if .Values.serve.rayActorOptions }}
{{- toYaml .Values.serve.rayActorOptions }}
{{- else if include "ferrox.hasGPUWorkers" . }}
{{- $o := dict "num_gpus" 1 }}
{{- with .Values.serve.acceleratorType }}{{ $_ := set $o "accelerator_type" . }}{{ end }}
{{- toYaml $o }}
{{- else }}
{{- toYaml (dict "num_cpus" 1) }}
{{- end }}
{{- end }}

{{/* A map without its null entries (helm keeps `key: null` from values files). */}}
{{- define "ferrox.compact" -}}
{{- $out := dict }}
{{- range $k, $v := . }}
{{- if not (kindIs "invalid" $v) }}{{ $_ := set $out $k $v }}{{ end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* AppArgs for ferrox.cluster.app:build_app, as a YAML mapping. */}}
{{- define "ferrox.appArgs" -}}
{{- $args := dict "model" .Values.model.name }}
{{- with .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end }}
{{- $a := .Values.serve.autoscaling }}
{{- if $a.enabled }}
{{- $as := dict "min_replicas" (int $a.minReplicas) "max_replicas" (int $a.maxReplicas) "target_ongoing_requests" $a.targetOngoingRequests }}
{{- if not (kindIs "invalid" $a.initialReplicas) }}{{ $_ := set $as "initial_replicas" (int $a.initialReplicas) }}{{ end }}
{{- $_ := set $args "autoscaling_config" $as }}
{{- else }}
{{- $_ := set $args "num_replicas" (int .Values.serve.numReplicas) }}
{{- end }}
{{- $_ := set $args "ray_actor_options" (include "ferrox.rayActorOptions" . | fromYaml) }}
{{- $_ := set $args "engine" (include "ferrox.compact" (default (dict) .Values.engine) | fromYaml) }}
{{- $_ := set $args "router" (include "ferrox.compact" (default (dict) .Values.router) | fromYaml) }}
{{- $_ := set $args "ingress" (include "ferrox.compact" (default (dict) .Values.ingress) | fromYaml) }}
{{- toYaml $args }}
{{- end }}

{{/*
The Serve config (ray.serve.schema.ServeDeploySchema) for serveConfigV2:
HTTP on every node at port 8000, one application.
*/}}
{{- define "ferrox.serveConfig" -}}
{{- $app := dict
      "name" .Values.serve.appName
      "route_prefix" .Values.serve.routePrefix
      "import_path" "ferrox.cluster.app:build_app"
      "args" (include "ferrox.appArgs" . | fromYaml) }}
{{- $cfg := dict
      "proxy_location" "EveryNode"
      "http_options" (dict "host" "0.0.0.0" "port" 8000)
      "applications" (list $app) }}
{{- toYaml $cfg }}
{{- end }}

{{/*
Environment every Ray container gets: the hub token, the cache location and
the user's extra variables. Expects the root context.
*/}}
{{- define "ferrox.commonEnv" -}}
{{- with .Values.model.hubToken }}
{{- if .secretName }}
- name: {{ .envName }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .secretKey }}
{{- end }}
{{- end }}
{{- if .Values.model.cache.enabled }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" (trimSuffix "/" .Values.model.cache.mountPath) | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The head's environment: the common variables, the Grafana/Prometheus hosts the
Ray dashboard embeds panels from, and the head's extra variables.
*/}}
{{- define "ferrox.headEnv" -}}
{{ include "ferrox.commonEnv" . }}
{{- with .Values.monitoring }}
{{- if .grafanaHost }}
- name: RAY_GRAFANA_HOST
  value: {{ .grafanaHost | quote }}
{{- end }}
{{- if .grafanaIframeHost }}
- name: RAY_GRAFANA_IFRAME_HOST
  value: {{ .grafanaIframeHost | quote }}
{{- end }}
{{- if .prometheusHost }}
- name: RAY_PROMETHEUS_HOST
  value: {{ .prometheusHost | quote }}
{{- end }}
{{- if .prometheusName }}
- name: RAY_PROMETHEUS_NAME
  value: {{ .prometheusName | quote }}
{{- end }}
{{- end }}
{{- with .Values.head.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The model cache volume (nothing when disabled). */}}
{{- define "ferrox.volumes" -}}
{{- $c := .Values.model.cache }}
{{- if $c.enabled }}
- name: model-cache
{{- $claim := include "ferrox.cacheClaimName" . }}
{{- if $claim }}
  persistentVolumeClaim:
    claimName: {{ $claim }}
{{- else if $c.emptyDirSizeLimit }}
  emptyDir:
    sizeLimit: {{ $c.emptyDirSizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}

{{- define "ferrox.volumeMounts" -}}
{{- if .Values.model.cache.enabled }}
- name: model-cache
  mountPath: {{ .Values.model.cache.mountPath }}
{{- end }}
{{- end }}

{{/*
Pod template metadata shared by the head and the workers. Only labels that
stay put across chart upgrades: KubeRay replaces the whole Ray cluster when
the pod templates change, so the chart version label stays off the pods.
*/}}
{{- define "ferrox.podMetadata" -}}
labels:
  {{- include "ferrox.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/part-of: ferrox
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the head and the workers. */}}
{{- define "ferrox.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- end }}
