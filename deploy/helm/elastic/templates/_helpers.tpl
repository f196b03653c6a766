{{/* The chart's name, the release's full name, and the labels every object carries. */}}
{{- define "elastic.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Objects' names begin with this (at most 40 characters: the longest suffix keeps each name within 63). */}}
{{- define "elastic.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "elastic.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "elastic.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The ServiceAccount discovery runs as: rbac.serviceAccountName (one made by the cluster's admins), else the
chart's own (rbac.create); empty: none. */}}
{{- define "elastic.discoveryServiceAccount" -}}
{{- if .Values.rbac.serviceAccountName -}}
{{- .Values.rbac.serviceAccountName -}}
{{- else if .Values.rbac.create -}}
{{- include "elastic.fullname" . }}-discovery
{{- end -}}
{{- end -}}

{{/* Whether agents prove their pods' identity to discovery (discovery.kubernetes.podIdentity): "true", else empty. */}}
{{- define "elastic.podIdentity" -}}
{{- if and .Values.discovery.kubernetes.enabled .Values.discovery.kubernetes.podIdentity.enabled -}}true{{- end -}}
{{- end -}}

{{/* The ServiceAccount the agents run as, whose tokens alone register hosts: agents.serviceAccountName, else the
chart's own (made with discovery's), else the namespace's default. */}}
{{- define "elastic.agentServiceAccount" -}}
{{- if .Values.agents.serviceAccountName -}}
{{- .Values.agents.serviceAccountName -}}
{{- else if and .Values.rbac.create (not .Values.rbac.serviceAccountName) -}}
{{- include "elastic.fullname" . }}-agent
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* (dict "root" $ "component" NAME) */}}
{{- define "elastic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastic.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "elastic.labels" -}}
{{ include "elastic.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The CLI's default ports (bus/config.py DEFAULT_PORTS) and each service's --metrics-port. */}}
{{- define "elastic.services" -}}
discovery: {port: 5550, metrics: 9550}
rendezvous: {port: 5551, metrics: 9551}
registry: {port: 5552, metrics: 9552}
notifier: {port: 5553, metrics: 9553, events: 5554}
{{- end -}}

{{- define "elastic.agentMetricsPort" -}}9555{{- end -}}

{{/* Pods per service: 1 in the single-host layout, else controlPlane.replicas (default 2). */}}
{{- define "elastic.replicas" -}}
{{- $r := .Values.controlPlane.replicas -}}
{{- if eq .Values.controlPlane.layout "single" -}}1{{- else if kindIs "invalid" $r -}}2{{- else -}}{{ int $r }}{{- end -}}
{{- end -}}

{{/* Values that make no sense together: one line each, through `fail`. */}}
{{- define "elastic.validate" -}}
{{- $cp := .Values.controlPlane -}}
{{- $a := .Values.agents -}}
{{- if lt (int $a.slots) 1 -}}
{{- fail (printf "agents.slots must be at least 1, got %v" $a.slots) -}}
{{- end -}}
{{- if and (eq $cp.layout "single") (not (kindIs "invalid" $cp.replicas)) (ne (int $cp.replicas) 1) -}}
{{- fail (printf "controlPlane.replicas %v: the single layout runs one pod per service (its registry writes one SQLite file); use controlPlane.layout=replicated for more" $cp.replicas) -}}
{{- end -}}
{{- if and (eq $cp.layout "replicated") (lt (int (include "elastic.replicas" .)) 2) -}}
{{- fail (printf "controlPlane.replicas %v: the replicated layout needs at least 2 per service" $cp.replicas) -}}
{{- end -}}
{{- $limit := dig "limits" "nvidia.com/gpu" nil ($a.resources | default dict) -}}
{{- if and (not (kindIs "bool" $a.gpus)) (ne (int $a.gpus) 0) (ne (int $a.gpus) (int $a.slots)) -}}
{{- fail (printf "agents.gpus %v does not match agents.slots %v: each slot is one GPU (nvidia.com/gpu = slots)" $a.gpus $a.slots) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $limit)) (ne (int $limit) (int $a.slots)) -}}
{{- fail (printf "agents.resources.limits nvidia.com/gpu %v does not match agents.slots %v" $limit $a.slots) -}}
{{- end -}}
{{- if and (not .Values.security.keysSecret) (not .Values.security.insecure) -}}
{{- fail "security.keysSecret is empty: make the keys with `elasticctl keys generate DIR` and a Secret from them (docs/security.md), or set security.insecure=true to run without authentication, where anyone who reaches the pods can run code on every agent" -}}
{{- end -}}
{{- if and (eq $cp.layout "replicated") .Values.security.keysSecret (not .Values.security.etcdTlsSecret) (not .Values.security.insecure) -}}
{{- fail "security.etcdTlsSecret is empty: the replicated layout's etcd needs its certificates (elasticctl keys generate DIR --etcd-host ...; docs/security.md), or set security.insecure=true for plain HTTP, where anyone who reaches etcd can rewrite the job" -}}
{{- end -}}
{{- end -}}

{{/* GPUs per agent pod: 0, or agents.slots. */}}
{{- define "elastic.gpus" -}}
{{- $g := .Values.agents.gpus -}}
{{- if kindIs "bool" $g -}}{{ if $g }}{{ int .Values.agents.slots }}{{ else }}0{{ end }}{{- else -}}{{ int $g }}{{- end -}}
{{- end -}}

{{/* The hosts of a service's pods, comma-separated: (dict "root" $ "service" NAME). */}}
{{- define "elastic.hosts" -}}
{{- $full := include "elastic.fullname" .root -}}
{{- $svc := printf "%s-%s" $full .service -}}
{{- if eq .root.Values.controlPlane.layout "single" -}}
{{- $svc -}}
{{- else -}}
{{- $hosts := list -}}
{{- range $i := until (int (include "elastic.replicas" .root)) -}}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc" $svc $i $svc $.root.Release.Namespace) -}}
{{- end -}}
{{- join "," $hosts -}}
{{- end -}}
{{- end -}}

{{/* tcp://HOST:PORT for each host of `service` on `port`: (dict "root" $ "service" NAME "port" PORT). */}}
{{- define "elastic.endpointList" -}}
{{- $port := .port -}}
{{- $list := list -}}
{{- range $h := splitList "," (include "elastic.hosts" .) -}}
{{- $list = append $list (printf "tcp://%s:%d" $h (int $port)) -}}
{{- end -}}
{{- join "," $list -}}
{{- end -}}

{{/* The environment every process of the release gets: the five endpoint lists, the intervals' preset and the
security settings. */}}
{{- define "elastic.commonEnv" -}}
{{- $root := . -}}
{{- $services := include "elastic.services" . | fromYaml -}}
{{- range $name := list "discovery" "rendezvous" "registry" "notifier" }}
- name: ELASTIC_{{ upper $name }}_ENDPOINT
  value: {{ include "elastic.endpointList" (dict "root" $root "service" $name "port" (get (get $services $name) "port")) | quote }}
{{- end }}
- name: ELASTIC_EVENTS_ENDPOINT
  value: {{ include "elastic.endpointList" (dict "root" $root "service" "notifier" "port" $services.notifier.events) | quote }}
- name: ELASTIC_TIMING
  value: {{ .Values.timing | default "local" | quote }}
{{- if .Values.security.keysSecret }}
- name: ELASTIC_KEYS
  value: /keys
{{- else }}
- name: ELASTIC_INSECURE
  value: "1"
{{- end }}
{{- end -}}

{{- define "elastic.podName" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* The keys a pod of `role` holds, mounted at /keys: (dict "root" $ "role" service|agent|operator). Each role gets
the server's public key and its own keypair (bus/roles.py); only the control plane's services get the server's secret
key, the authorised public keys of every role, the operator's keypair (so that `kubectl exec` into a control-plane pod
can run elasticctl) and etcd's client certificate. */}}
{{- define "elastic.keysMount" -}}
{{- if .root.Values.security.keysSecret }}
- name: keys
  mountPath: /keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "elastic.keysVolume" -}}
{{- $security := .root.Values.security -}}
{{- if $security.keysSecret }}
{{- $own := dict "service" (list "service" "client") "agent" (list "agent") "operator" (list "client") }}
- name: keys
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ $security.keysSecret }}
          items:
            - {key: server.key, path: server.key}
            {{- if eq .role "service" }}
            - {key: server.key_secret, path: server.key_secret}
            {{- range $name := list "service" "agent" "client" }}
            - {key: {{ $name }}.key, path: authorized/{{ $name }}.key}
            {{- end }}
            {{- end }}
            {{- range $name := get $own .role }}
            - {key: {{ $name }}.key, path: {{ $name }}.key}
            - {key: {{ $name }}.key_secret, path: {{ $name }}.key_secret}
            {{- end }}
      {{- if and (eq .role "service") (eq .root.Values.controlPlane.layout "replicated") $security.etcdTlsSecret }}
      - secret:
          name: {{ $security.etcdTlsSecret }}
          items:
            - {key: ca.crt, path: etcd/ca.crt}
            - {key: client.crt, path: etcd/client.crt}
            - {key: client.key, path: etcd/client.key}
      {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level security: the image's user (uid 10001), which owns the mounted volumes through fsGroup, and the
runtime's seccomp profile. */}}
{{- define "elastic.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "elastic.image" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* Spread pods with these selector labels over nodes: (dict "root" $ "component" NAME "mode" required|preferred). */}}
{{- define "elastic.antiAffinity" -}}
affinity:
  podAntiAffinity:
{{- if eq .mode "required" }}
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "elastic.selectorLabels" . | nindent 12 }}
{{- else }}
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "elastic.selectorLabels" . | nindent 14 }}
{{- end }}
{{- end -}}

{{- define "elastic.etcdStore" -}}
{{- $full := include "elastic.fullname" . -}}
{{- $members := list -}}
{{- range $i := until 3 -}}
{{- $members = append $members (printf "%s-etcd-%d.%s-etcd.%s.svc:2379" $full $i $full $.Release.Namespace) -}}
{{- end -}}
etcd://{{ join "," $members }}
{{- end -}}

{{/* A pod template's labels: the selector's, who manages it and the values' own (pod.labels); no chart or app
version, so that a chart upgrade changes no pod template and restarts nothing: (dict "root" $ "component" NAME
"pod" VALUES.pod). */}}
{{- define "elastic.podLabels" -}}
{{ include "elastic.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .pod.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The pod template's metadata: (dict "root" $ "component" NAME "pod" VALUES.pod). */}}
{{- define "elastic.podMetadata" -}}
metadata:
  labels:
    {{- include "elastic.podLabels" . | nindent 4 }}
  {{- with .pod.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* What a values `pod` block adds to a pod spec beside the containers: its scheduling and runtime settings, init
containers and resource claims. */}}
{{- define "elastic.podExtras" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .initContainers }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .resourceClaims }}
resourceClaims:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A container's security context, as the `restricted` Pod Security Standard asks: no privilege escalation, every
capability dropped (`add`: the few a values file asks back, e.g. IPC_LOCK for RDMA), the runtime's seccomp profile, a
non-root user and, where the process writes only to its volumes, a read-only root filesystem: (dict "readOnly" BOOL
"add" LIST). */}}
{{- define "elastic.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: [ALL]
    {{- with .add }}
    add:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  readOnlyRootFilesystem: {{ .readOnly }}
  runAsNonRoot: true
  seccompProfile:
    type: RuntimeDefault
{{- end -}}
