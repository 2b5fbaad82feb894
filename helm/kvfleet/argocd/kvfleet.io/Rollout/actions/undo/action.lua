-- Writes an "undo" request into the kvfleet.io/rollout-request annotation (what `kubectl
-- kvfleet rollout undo` writes), never the spec: Git keeps owning it. After a promotion, while
-- the revision that served before it is kept, the operator sends all traffic back to that
-- revision and rolls the promoted one back. The id makes the request idempotent.
-- Argo CD opens only its safe part of os (time, date), through require.
local os = require("os")
local id = "argocd-undo-" .. tostring(os.time())
local request = "{\"action\": \"undo\", \"id\": \"" .. id .. "\""
request = request .. "}"
if obj.metadata.annotations == nil then
  obj.metadata.annotations = {}
end
obj.metadata.annotations["kvfleet.io/rollout-request"] = request
return obj
