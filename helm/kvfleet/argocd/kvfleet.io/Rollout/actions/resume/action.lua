-- Writes a "resume" request into the kvfleet.io/rollout-request annotation (what `kubectl
-- kvfleet rollout resume` writes), never the spec: Git keeps owning it. The id makes the
-- request idempotent; the operator acts on each id once.
-- Argo CD opens only its safe part of os (time, date), through require.
local os = require("os")
local id = "argocd-resume-" .. tostring(os.time())
local request = "{\"action\": \"resume\", \"id\": \"" .. id .. "\""
request = request .. "}"
if obj.metadata.annotations == nil then
  obj.metadata.annotations = {}
end
obj.metadata.annotations["kvfleet.io/rollout-request"] = request
return obj
