-- kvfleet.io/ServingPool, from the conditions the operator writes: Degraded=True is Degraded
-- (its reason and message), Progressing=True is Progressing (a new revision or a rollout under
-- way), Available=True is Healthy (serving at least the disruption budget's minimum). A pool
-- whose rollout failed keeps serving its stable revision and stays Healthy here: the Rollout
-- object carries the failure. Argo CD runs this in gopher-lua with only the base, table and
-- os libraries.
local hs = {}
local status = obj.status
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe the pool"
  return hs
end
if obj.metadata.generation ~= nil and status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe generation " ..
    tostring(obj.metadata.generation)
  return hs
end
local conditions = {}
if status.conditions ~= nil then
  for _, condition in ipairs(status.conditions) do
    conditions[condition.type] = condition
  end
end
local degraded = conditions["Degraded"]
local progressing = conditions["Progressing"]
local available = conditions["Available"]
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = tostring(degraded.reason) .. ": " .. tostring(degraded.message)
  return hs
end
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = tostring(progressing.reason) .. ": " .. tostring(progressing.message)
  return hs
end
if available ~= nil and available.status == "True" then
  hs.status = "Healthy"
  hs.message = tostring(available.message)
  return hs
end
hs.status = "Progressing"
if available ~= nil then
  hs.message = tostring(available.reason) .. ": " .. tostring(available.message)
else
  hs.message = "Waiting for the pool's replicas"
end
return hs
