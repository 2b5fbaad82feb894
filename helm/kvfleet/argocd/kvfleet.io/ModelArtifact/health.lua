-- kvfleet.io/ModelArtifact: Healthy once the operator verified the manifest and the
-- compatibility matrix allows it (Ready=True); Degraded with the failing condition's reason.
-- Argo CD runs this in gopher-lua with only the base, table and os libraries.
local hs = {}
local generation = obj.metadata.generation
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to verify the artifact"
  return hs
end
local ready = nil
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then
    ready = condition
  end
end
if ready == nil or (generation ~= nil and ready.observedGeneration ~= nil
    and ready.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to verify the artifact"
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = "Verified: manifest hash " .. tostring(obj.status.manifestHash)
  return hs
end
hs.status = "Degraded"
hs.message = tostring(ready.reason) .. ": " .. tostring(ready.message)
return hs
