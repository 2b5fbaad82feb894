-- Writes a "promote" request into the kvfleet.io/rollout-request annotation (what `kubectl
-- kvfleet rollout promote` writes), never the spec: Git keeps owning it. The id makes the
-- request idempotent; the operator acts on each id once.
-- Argo CD opens only its safe part of os (time, date), through require.
local os = require("os")
local id = "argocd-promote-" .. tostring(os.time())
local request = "{\"action\": \"promote\", \"id\": \"" .. id .. "\""
local step = obj.status.currentStep
-- A promote applies to the step it names: clicked twice, it never skips two steps.
request = request .. ", \"step\": " .. tostring(step)
request = request .. "}"
if obj.metadata.annotations == nil then
  obj.metadata.annotations = {}
end
obj.metadata.annotations["kvfleet.io/rollout-request"] = request
return obj
