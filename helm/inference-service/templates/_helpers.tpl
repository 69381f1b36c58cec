{{/* Names and labels shared by every template. */}}

{{- define "inference-service.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; components append -engine, -proxy, -envoy (so at most 56 characters here). */}}
{{- define "inference-service.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 56 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "inference-service.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "inference-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "engine"). */}}
{{- define "inference-service.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inference-service.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "inference-service.componentLabels" -}}
{{ include "inference-service.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "inference-service.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The engine's headless Service: its DNS name resolves to every ready engine pod (Envoy's upstreams). */}}
{{- define "inference-service.engineHeadless" -}}
{{- printf "%s-engine-headless" (include "inference-service.fullname" .) }}
{{- end }}

{{/* Where the proxy sends gRPC: Envoy when enabled, else the engine Service directly. */}}
{{- define "inference-service.proxyEngineTarget" -}}
{{- if .Values.envoy.enabled }}
{{- printf "%s-envoy:%d" (include "inference-service.fullname" .) (int .Values.envoy.port) }}
{{- else }}
{{- printf "%s-engine:%d" (include "inference-service.fullname" .) (int .Values.engine.port) }}
{{- end }}
{{- end }}

{{- define "inference-service.apiKeySecret" -}}
{{- default (printf "%s-proxy" (include "inference-service.fullname" .)) .Values.proxy.apiKey.existingSecret }}
{{- end }}

{{- define "inference-service.mcpConfigMap" -}}
{{- default (printf "%s-mcp" (include "inference-service.fullname" .)) .Values.proxy.mcp.existingConfigMap }}
{{- end }}

{{- define "inference-service.mcpEnabled" -}}
{{- if or .Values.proxy.mcp.existingConfigMap .Values.proxy.mcp.servers }}true{{- end }}
{{- end }}

{{/* The Secret holding the engines' API key, or nothing when there is no key. */}}
{{- define "inference-service.engineApiKeySecret" -}}
{{- if .Values.engine.apiKey.existingSecret }}
{{- .Values.engine.apiKey.existingSecret }}
{{- else if .Values.engine.apiKey.value }}
{{- printf "%s-engine" (include "inference-service.fullname" .) }}
{{- end }}
{{- end }}
