{{/* Names, labels, images and the checks every template shares. */}}

{{- define "pagedkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix of resource names (trimmed so "-scheduler" fits in 63). */}}
{{- define "pagedkv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagedkv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one tier: (dict "ctx" $ "component" "scheduler"). */}}
{{- define "pagedkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedkv.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pagedkv.labels" -}}
{{ include "pagedkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pagedkv
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "pagedkv.chart" .ctx }}
{{- end -}}

{{/* A tier's resource name: (dict "ctx" $ "component" "executor"). */}}
{{- define "pagedkv.componentName" -}}
{{- printf "%s-%s" (include "pagedkv.fullname" .ctx) .component -}}
{{- end -}}

{{- define "pagedkv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagedkv.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: (dict "ctx" $ "image" .Values.images.executor) */}}
{{- define "pagedkv.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The Redis URL every pagedkv process takes (no password in it: that comes from a file). */}}
{{- define "pagedkv.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc.%s:6379/0" (include "pagedkv.componentName" (dict "ctx" . "component" "redis")) .Release.Namespace .Values.clusterDomain -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "pagedkv.redisSecretName" -}}
{{- default (printf "%s-redis" (include "pagedkv.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "pagedkv.authSecretName" -}}
{{- default (printf "%s-auth" (include "pagedkv.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* A tier's TLS Secret: (dict "ctx" $ "component" "router"). */}}
{{- define "pagedkv.tlsSecretName" -}}
{{- $existing := get .ctx.Values.tls.existingSecrets .component -}}
{{- if .ctx.Values.tls.generate -}}
{{- printf "%s-%s-tls" (include "pagedkv.fullname" .ctx) .component -}}
{{- else -}}
{{- $existing -}}
{{- end -}}
{{- end -}}

{{/* Seconds a pod gets to stop: the preStop sleep, the drain, and 10 s to hand over and exit. */}}
{{- define "pagedkv.terminationGracePeriod" -}}
{{- add (int .preStopSleepSeconds) (ceil .drainTimeout | int) 10 -}}
{{- end -}}

{{/*
The values no schema can check (they depend on each other); fails with a
message saying what to set. Every workload template includes it.
*/}}
{{- define "pagedkv.validate" -}}
{{- $model := .Values.model -}}
{{- $_ := required "model.name is required: the model directory under model.mountPath (or a hub id with model.hubCache)" $model.name -}}
{{- $pvc := $model.persistentVolumeClaim.claimName -}}
{{- $host := $model.hostPath.path -}}
{{- if and $pvc $host -}}
{{- fail "model: set one of model.persistentVolumeClaim.claimName and model.hostPath.path, not both" -}}
{{- end -}}
{{- if not (or $pvc $host) -}}
{{- fail "model: set model.persistentVolumeClaim.claimName or model.hostPath.path (the volume holding the model)" -}}
{{- end -}}
{{- if and $model.hubCache $model.mountOnSchedulers -}}
{{- fail "model.mountOnSchedulers needs a model directory: schedulers and routers cannot read a hub cache (model.hubCache)" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.url -}}
{{- fail "redis.url is for an external Redis: set redis.enabled=false with it (or leave redis.url empty for the bundled one)" -}}
{{- end -}}
{{- else -}}
{{- $_ := required "redis.url is required when redis.enabled is false (redis://HOST:PORT/DB of the external Redis)" .Values.redis.url -}}
{{- if and .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret) -}}
{{- fail "redis.auth.existingSecret is required for an external Redis with redis.auth.enabled (or set redis.auth.enabled=false)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tls.generate (not .Values.tls.enabled) -}}
{{- fail "tls.generate makes certificates for tls.enabled: set tls.enabled=true too" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.generate) -}}
{{- $tiers := list "scheduler" "executor" -}}
{{- if .Values.router.enabled -}}{{- $tiers = append $tiers "router" -}}{{- end -}}
{{- if .Values.gateway.enabled -}}{{- $tiers = append $tiers "gateway" -}}{{- end -}}
{{- range $tiers -}}
{{- if not (get $.Values.tls.existingSecrets .) -}}
{{- fail (printf "tls.existingSecrets.%s is required with tls.enabled unless tls.generate is true" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
