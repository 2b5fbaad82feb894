-- Writes an "abort" request into the kvfleet.io/rollout-request annotation (what `kubectl
-- kvfleet rollout abort` writes), never the spec: Git keeps owning it. The id makes the request
-- idempotent; the operator acts on each id once.
-- Argo CD opens only its safe part of os (time, date), through require.
local os = require("os")
local id = "argocd-abort-" .. tostring(os.time())
local request = "{\"action\": \"abort\", \"id\": \"" .. id .. "\""
request = request .. "}"
if obj.metadata.annotations == nil then
  obj.metadata.annotations = {}
end
obj.metadata.annotations["kvfleet.io/rollout-request"] = request
return obj
