{{/*
The command lines of the tiers and the gateway (after the image's ENTRYPOINT, pagedkv).
Each flag is one list item and its value the next, all strings; the paths of
--tls-*, --*-token-file and --redis-password-file lie under the Secret
mounts of _pod.tpl.
*/}}

{{/* A command line as a YAML list of strings (numbers too: args are strings). */}}
{{- define "pagedkv.argList" -}}
{{- $strings := list -}}
{{- range . -}}{{- $strings = append $strings (toString .) -}}{{- end -}}
{{- toYaml $strings -}}
{{- end -}}

{{/* Flags every pagedkv process takes for Redis. */}}
{{- define "pagedkv.redisArgs" -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
{{- $args := list "--redis-url" (include "pagedkv.redisUrl" .) -}}
{{- if .Values.redis.auth.enabled -}}
{{- $args = concat $args (list "--redis-password-file" (printf "%s/password" $paths.redisDir)) -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{/* --tls-cert/--tls-key of a server (and its plaintext --health-port for the probes), with
--tls-ca when it requires client certificates: (dict "ctx" $ "tier" .Values.router "requireClientCerts" false). */}}
{{- define "pagedkv.serverTlsArgs" -}}
{{- $paths := include "pagedkv.paths" .ctx | fromYaml -}}
{{- $args := list -}}
{{- if .ctx.Values.tls.enabled -}}
{{- $args = list "--tls-cert" (printf "%s/tls.crt" $paths.tlsDir) "--tls-key" (printf "%s/tls.key" $paths.tlsDir)
    "--health-port" (toString .tier.healthPort) -}}
{{- if .requireClientCerts -}}
{{- $args = concat $args (list "--tls-ca" (printf "%s/ca.crt" $paths.tlsDir)) -}}
{{- end -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{- define "pagedkv.modelArg" -}}
{{- if .Values.model.hubCache -}}
{{- .Values.model.name -}}
{{- else -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") (.Values.model.name | trimPrefix "/") -}}
{{- end -}}
{{- end -}}

{{- define "pagedkv.executor.args" -}}
{{- $v := .Values.executor -}}
{{- $svc := include "pagedkv.componentName" (dict "ctx" . "component" "executor") -}}
{{- $advertise := printf "$(POD_NAME).%s.%s.svc.%s:%d" $svc .Release.Namespace .Values.clusterDomain (int $v.port) -}}
{{- $args := list "--log-format" .Values.logFormat "executor"
    "--model" (include "pagedkv.modelArg" .)
    "--device" "cuda"
    "--host" "0.0.0.0"
    "--port" (toString $v.port)
    "--advertise-address" $advertise
    "--dtype" $v.dtype
    "--kernel-backend" $v.kernelBackend
    "--drain-timeout" (toString $v.drainTimeout)
    "--no-progress" -}}
{{- if $v.numBlocks -}}
{{- $args = concat $args (list "--num-blocks" (toString $v.numBlocks)) -}}
{{- else -}}
{{- $args = concat $args (list "--gpu-memory-utilization" (toString $v.gpuMemoryUtilization)) -}}
{{- end -}}
{{- if $v.maxModelLen -}}
{{- $args = concat $args (list "--max-model-len" (toString $v.maxModelLen)) -}}
{{- end -}}
{{- if $v.enforceEager -}}
{{- $args = append $args "--enforce-eager" -}}
{{- end -}}
{{- $args = concat $args (include "pagedkv.redisArgs" . | fromJsonArray) -}}
{{- $args = concat $args (include "pagedkv.serverTlsArgs" (dict "ctx" . "tier" $v "requireClientCerts" true) | fromJsonArray) -}}
{{- $args = concat $args $v.extraArgs -}}
{{- include "pagedkv.argList" $args -}}
{{- end -}}

{{- define "pagedkv.scheduler.args" -}}
{{- $v := .Values.scheduler -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
{{- $args := list "--log-format" .Values.logFormat "scheduler"
    "--host" "0.0.0.0"
    "--port" (toString $v.port)
    "--advertise-address" (printf "$(POD_IP):%d" (int $v.port))
    "--metrics-port" (toString $v.metricsPort)
    "--drain-timeout" (toString $v.drainTimeout)
    "--lease-ttl" (toString $v.leaseTtl)
    "--max-num-seqs" (toString $v.maxNumSeqs)
    "--max-num-batched-tokens" (toString $v.maxNumBatchedTokens) -}}
{{- if .Values.model.mountOnSchedulers -}}
{{- $args = concat $args (list "--model" (include "pagedkv.modelArg" .)) -}}
{{- end -}}
{{- $args = concat $args (include "pagedkv.redisArgs" . | fromJsonArray) -}}
{{- $args = concat $args (include "pagedkv.serverTlsArgs" (dict "ctx" . "tier" $v "requireClientCerts" .Values.tls.requireClientCertificates) | fromJsonArray) -}}
{{- if .Values.tls.enabled -}}
{{- $args = concat $args (list
    "--executor-tls-ca" (printf "%s/ca.crt" $paths.tlsDir)
    "--executor-tls-cert" (printf "%s/tls.crt" $paths.tlsDir)
    "--executor-tls-key" (printf "%s/tls.key" $paths.tlsDir)) -}}
{{- end -}}
{{- if .Values.auth.enabled -}}
{{- $args = concat $args (list "--auth-token-file" (printf "%s/tokens" $paths.authDir)) -}}
{{- end -}}
{{- $args = concat $args $v.extraArgs -}}
{{- include "pagedkv.argList" $args -}}
{{- end -}}

{{- define "pagedkv.router.args" -}}
{{- $v := .Values.router -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
{{- $args := list "--log-format" .Values.logFormat "router"
    "--host" "0.0.0.0"
    "--port" (toString $v.port)
    "--metrics-port" (toString $v.metricsPort)
    "--policy" $v.policy
    "--drain-timeout" (toString $v.drainTimeout) -}}
{{- if .Values.model.mountOnSchedulers -}}
{{- $args = concat $args (list "--model" (include "pagedkv.modelArg" .)) -}}
{{- end -}}
{{- $args = concat $args (include "pagedkv.redisArgs" . | fromJsonArray) -}}
{{- $args = concat $args (include "pagedkv.serverTlsArgs" (dict "ctx" . "tier" $v "requireClientCerts" .Values.tls.requireClientCertificates) | fromJsonArray) -}}
{{- if .Values.tls.enabled -}}
{{- /* Schedulers register their pod IPs, which no install-time certificate can
name: their certificates are checked against their Service's name instead. */}}
{{- $schedulers := include "pagedkv.componentName" (dict "ctx" . "component" "scheduler") -}}
{{- $args = concat $args (list
    "--scheduler-tls-ca" (printf "%s/ca.crt" $paths.tlsDir)
    "--scheduler-tls-server-name" (printf "%s.%s.svc" $schedulers .Release.Namespace)) -}}
{{- if .Values.tls.requireClientCertificates -}}
{{- $args = concat $args (list
    "--scheduler-tls-cert" (printf "%s/tls.crt" $paths.tlsDir)
    "--scheduler-tls-key" (printf "%s/tls.key" $paths.tlsDir)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.auth.enabled -}}
{{- $args = concat $args (list
    "--auth-token-file" (printf "%s/tokens" $paths.authDir)
    "--scheduler-token-file" (printf "%s/internal-token" $paths.authDir)) -}}
{{- end -}}
{{- $args = concat $args $v.extraArgs -}}
{{- include "pagedkv.argList" $args -}}
{{- end -}}

{{/* What the gateway calls: the router Service, or the scheduler Service
without routers, by the name their certificates carry. */}}
{{- define "pagedkv.gateway.target" -}}
{{- $front := ternary "router" "scheduler" .Values.router.enabled -}}
{{- $svc := include "pagedkv.componentName" (dict "ctx" . "component" $front) -}}
{{- printf "%s.%s.svc:%d" $svc .Release.Namespace (int (get .Values $front).service.port) -}}
{{- end -}}

{{/* The gateway's bearer tokens (--auth-token-file): its own API keys' Secret, else the
chart's tokens with auth.enabled; empty: it asks none. */}}
{{- define "pagedkv.gateway.tokensPath" -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
{{- if .Values.gateway.auth.existingSecret -}}
{{- printf "%s/tokens" $paths.apiKeysDir -}}
{{- else if .Values.auth.enabled -}}
{{- printf "%s/tokens" $paths.authDir -}}
{{- end -}}
{{- end -}}

{{- define "pagedkv.gateway.args" -}}
{{- $v := .Values.gateway -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
{{- $args := list "--log-format" .Values.logFormat "gateway"
    "--target" (include "pagedkv.gateway.target" .)
    "--model" (include "pagedkv.modelArg" .)
    "--served-model-name" (default .Values.model.name $v.servedModelName)
    "--host" "0.0.0.0"
    "--port" (toString $v.port)
    "--drain-timeout" (toString $v.drainTimeout) -}}
{{- with include "pagedkv.gateway.tokensPath" . -}}
{{- $args = concat $args (list "--auth-token-file" .) -}}
{{- end -}}
{{- /* Credentials towards its targets, as the routers' towards schedulers. */}}
{{- if .Values.auth.enabled -}}
{{- $args = concat $args (list "--token-file" (printf "%s/internal-token" $paths.authDir)) -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $args = concat $args (list "--tls-ca" (printf "%s/ca.crt" $paths.tlsDir)) -}}
{{- if .Values.tls.requireClientCertificates -}}
{{- $args = concat $args (list
    "--tls-cert" (printf "%s/tls.crt" $paths.tlsDir)
    "--tls-key" (printf "%s/tls.key" $paths.tlsDir)) -}}
{{- end -}}
{{- end -}}
{{- $args = concat $args $v.extraArgs -}}
{{- include "pagedkv.argList" $args -}}
{{- end -}}
