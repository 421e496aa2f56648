{{/*
Pod pieces the tiers share: where Secrets and caches are mounted, probes,
security contexts. The flags that name these paths are built in _args.tpl.
*/}}

{{- define "pagedkv.paths" -}}
tlsDir: /etc/pagedkv/tls
authDir: /etc/pagedkv/auth
redisDir: /etc/pagedkv/redis
apiKeysDir: /etc/pagedkv/api-keys
{{- end -}}

{{/* Volumes of a pagedkv pod: (dict "ctx" $ "component" "scheduler" "auth" true "redis" true
"model" false); "redis": the Redis password (every tier but the gateway, which has no Redis). */}}
{{- define "pagedkv.volumes" -}}
{{- $ctx := .ctx -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if $ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pagedkv.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- if and .auth $ctx.Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ include "pagedkv.authSecretName" $ctx }}
    defaultMode: 0440
{{- end }}
{{- if and .redis $ctx.Values.redis.auth.enabled }}
- name: redis-password
  secret:
    secretName: {{ include "pagedkv.redisSecretName" $ctx }}
    defaultMode: 0440
    items:
      - key: {{ $ctx.Values.redis.auth.passwordKey }}
        path: password
{{- end }}
{{- if .model }}
- name: model
  {{- if $ctx.Values.model.persistentVolumeClaim.claimName }}
  persistentVolumeClaim:
    claimName: {{ $ctx.Values.model.persistentVolumeClaim.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ $ctx.Values.model.hostPath.path }}
    type: Directory
  {{- end }}
{{- end }}
{{- end -}}

{{/* The mounts of the volumes above, same arguments. */}}
{{- define "pagedkv.volumeMounts" -}}
{{- $ctx := .ctx -}}
{{- $paths := include "pagedkv.paths" . | fromYaml -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/pagedkv
{{- if $ctx.Values.tls.enabled }}
- name: tls
  mountPath: {{ $paths.tlsDir }}
  readOnly: true
{{- end }}
{{- if and .auth $ctx.Values.auth.enabled }}
- name: auth
  mountPath: {{ $paths.authDir }}
  readOnly: true
{{- end }}
{{- if and .redis $ctx.Values.redis.auth.enabled }}
- name: redis-password
  mountPath: {{ $paths.redisDir }}
  readOnly: true
{{- end }}
{{- if .model }}
- name: model
  mountPath: {{ $ctx.Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A check of a server's grpc.health.v1: (dict "ctx" $ "tier" .Values.scheduler).
The kubelet's gRPC probe speaks plaintext only, so with TLS it asks the
plaintext health-only port (--health-port) instead of the TLS port.
*/}}
{{- define "pagedkv.healthCheck" -}}
grpc:
  port: {{ ternary .tier.healthPort .tier.port .ctx.Values.tls.enabled }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end -}}

{{/* Readiness and liveness probes, same arguments; "liveness": the health
service name the liveness probe asks instead of the server's overall health
(schedulers and routers: "liveness" stays SERVING while they wait for Redis,
when their overall health is NOT_SERVING; a restart would not bring Redis
back). */}}
{{- define "pagedkv.probes" -}}
readinessProbe:
  {{- include "pagedkv.healthCheck" . | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- include "pagedkv.healthCheck" (dict "ctx" .ctx "tier" .tier "service" .liveness) | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* The container's ports: (dict "ctx" $ "tier" .Values.scheduler "metrics" true). */}}
{{- define "pagedkv.ports" -}}
- name: grpc
  containerPort: {{ .tier.port }}
  protocol: TCP
{{- if .ctx.Values.tls.enabled }}
- name: health
  containerPort: {{ .tier.healthPort }}
  protocol: TCP
{{- end }}
{{- if .metrics }}
- name: metrics
  containerPort: {{ .tier.metricsPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Environment of every pagedkv container. */}}
{{- define "pagedkv.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /var/cache/pagedkv
{{- if .Values.model.hubCache }}
- name: HF_HUB_CACHE
  value: {{ .Values.model.mountPath }}
{{- end }}
{{- end -}}

{{/* Pod spec fields before the containers: (dict "ctx" $ "tier" .Values.scheduler). */}}
{{- define "pagedkv.podCommon" -}}
serviceAccountName: {{ include "pagedkv.serviceAccountName" .ctx }}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ include "pagedkv.terminationGracePeriod" .tier }}
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tier.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tier.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tier.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* preStop: keep serving while endpoints forget the pod; then SIGTERM starts the drain. */}}
{{- define "pagedkv.lifecycle" -}}
{{- if gt (int .preStopSleepSeconds) 0 -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .preStopSleepSeconds }}
{{- end -}}
{{- end -}}
