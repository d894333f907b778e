{{/* Chart name, shortened to 63 characters (DNS label). */}}
{{- define "finetune-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: <release>-<chart>, or the release alone if it holds the chart name. */}}
{{- define "finetune-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "finetune-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels selecting the operator pods; never change them after a release (selectors are immutable). */}}
{{- define "finetune-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "finetune-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object of the chart. */}}
{{- define "finetune-operator.labels" -}}
{{ include "finetune-operator.selectorLabels" . }}
helm.sh/chart: {{ include "finetune-operator.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: finetune-operator
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "finetune-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "finetune-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "finetune-operator.image" -}}
{{- $repo := .Values.image.repository }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repo .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "finetune-operator.trainerImage" -}}
{{- $repo := .Values.trainer.image.repository }}
{{- if .Values.trainer.image.digest }}
{{- printf "%s@%s" $repo .Values.trainer.image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.trainer.image.tag) }}
{{- end }}
{{- end }}

{{/* The trainer ServiceAccount of jobs that name none ("" = the namespace's default). */}}
{{- define "finetune-operator.trainerServiceAccountName" -}}
{{- if .Values.trainer.serviceAccount.create }}
{{- default (printf "%s-trainer" (include "finetune-operator.fullname" .) | trunc 63 | trimSuffix "-") .Values.trainer.serviceAccount.name }}
{{- else }}
{{- .Values.trainer.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespaces that get the trainer ServiceAccount, as a JSON list. */}}
{{- define "finetune-operator.trainerNamespaces" -}}
{{- if .Values.trainer.serviceAccount.namespaces }}
{{- .Values.trainer.serviceAccount.namespaces | uniq | toJson }}
{{- else if .Values.operator.clusterWide }}
{{- list .Release.Namespace | toJson }}
{{- else }}
{{- include "finetune-operator.watchNamespaces" . }}
{{- end }}
{{- end }}

{{/* Namespaces watched when not cluster-wide, as a JSON list (use with fromJsonArray). */}}
{{- define "finetune-operator.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces }}
{{- .Values.operator.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "finetune-operator.peeringName" -}}
{{- default (include "finetune-operator.fullname" .) .Values.leaderElection.peeringName }}
{{- end }}

{{/* Runbook link of an alert: <runbookBaseUrl>#<alert name lowercased> (a docs/alerts.md heading). */}}
{{- define "finetune-operator.runbookUrl" -}}
{{- printf "%s#%s" (.root.Values.prometheus.rules.runbookBaseUrl | trimSuffix "/") (lower .alert) }}
{{- end }}

{{/* Fail early on value combinations the schema cannot express. */}}
{{- define "finetune-operator.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicaCount > 1 requires leaderElection.enabled=true: two standalone operators would both handle every FineTuneJob" }}
{{- end }}
{{- if and .Values.prometheus.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "prometheus.serviceMonitor.enabled requires metrics.service.enabled=true" }}
{{- end }}
{{- with .Values.gangScheduling }}
{{- if and .default (not (has .default .schedulers)) }}
{{- fail (printf "gangScheduling.default %s must be one of gangScheduling.schedulers (the operator may manage only their PodGroups)" .default) }}
{{- end }}
{{- if and .schedulerName (not .default) }}
{{- fail "gangScheduling.schedulerName applies to gangScheduling.default: set it too" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Rules for the objects of FineTuneJobs: in the ClusterRole when cluster-wide, else in a Role per namespace. */}}
{{- define "finetune-operator.jobRules" -}}
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "delete", "get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["create", "delete", "get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "delete", "get", "list", "watch", "patch"]
{{- end }}
{{- with include "finetune-operator.gangApiGroups" . | fromJsonArray }}
- apiGroups: {{ toJson . }}
  resources: ["podgroups"]
  verbs: ["create", "get", "patch", "delete"]
{{- end }}
{{- if .Values.kueue.enabled }}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["create", "get", "list", "watch", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}

{{/* API groups of the PodGroups of gangScheduling.schedulers (scheduler-plugins' Coscheduling, Volcano). */}}
{{- define "finetune-operator.gangApiGroups" -}}
{{- $groups := dict "coscheduling" "scheduling.x-k8s.io" "volcano" "scheduling.volcano.sh" -}}
{{- $out := list -}}
{{- range .Values.gangScheduling.schedulers }}{{ $out = append $out (get $groups .) }}{{ end -}}
{{- toJson $out -}}
{{- end }}
