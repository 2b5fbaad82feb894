{{/* The image every component runs. */}}
{{- define "kvfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Labels of every object, plus the component's. */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
app.kubernetes.io/name: kvfleet-{{ .component }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvfleet.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/name: kvfleet-{{ .component }}
{{- end -}}

{{/* Pod Security "restricted": the pod and container halves. */}}
{{- define "kvfleet.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvfleet.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The router's namespace. */}}
{{- define "kvfleet.routerNamespace" -}}
{{ .Values.router.namespace | default .Release.Namespace }}
{{- end -}}
